//! Lines for a person at a terminal ([`rdzv::uring::NOTICE`]: "connecting to H:P,
//! retrying for 28 s more: …") print bare; every other event as `tracing`'s text format
//! prints it, with its time, level and module.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// An event format that prints [`NOTICE`](rdzv::uring::NOTICE) events as their message
/// alone, and hands the others to `F`.
pub(crate) struct Bare<F>(pub(crate) F);

impl<S, N, F> FormatEvent<S, N> for Bare<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if event.metadata().target() != rdzv::uring::NOTICE {
            return self.0.format_event(ctx, writer, event);
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        writeln!(writer, "{}", message.0)
    }
}

/// The `message` field of an event.
struct Message(String);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            use fmt::Write;
            let _ = write!(self.0, "{value:?}");
        }
    }
}
