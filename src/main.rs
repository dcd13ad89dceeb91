//! The `rdzv` command line: run a store, talk to one, and see rendezvous work.

mod args;
mod cli;
mod demo;
mod elastic_cli;
mod error;
mod notice;
mod sd_notify;
mod status_cli;
mod store_client;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format() {
        // One JSON object per event, for log collectors.
        cli::LogFormat::Json => logs.json().init(),
        cli::LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .event_format(notice::Bare(tracing_subscriber::fmt::format()))
            .init(),
    }
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rdzv: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// `error` and every error in its `source()` chain on one line (`{e:#}` on a boxed error
/// prints only the top one).
pub(crate) use rdzv::uring::rpc::error_chain;

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn the_whole_chain_is_printed_once() {
        let io = Layer("connection refused", None);
        let connect = Layer(
            "cannot reach the store at 10.0.0.1:29500",
            Some(Box::new(io)),
        );
        let top = Layer("rank 3: rendezvous failed", Some(Box::new(connect)));
        assert_eq!(
            error_chain(&top),
            "rank 3: rendezvous failed: cannot reach the store at 10.0.0.1:29500: connection refused"
        );
        // A message that already quotes its source does not repeat it.
        let quoted = Layer(
            "store: connection refused",
            Some(Box::new(Layer("connection refused", None))),
        );
        assert_eq!(error_chain(&quoted), "store: connection refused");
    }
}
