//! A fake GPU for tests of the CUDA ordering rules (test builds only): streams are
//! queues that run only when a test steps them, events count records (issued and
//! completed), buffers are named host vectors. Work therefore completes as late as the
//! test wants, so a copy read too early, or memory reused under a running copy, shows
//! up as wrong bytes. It implements [`LoanStream`] and [`LoanEvent`].

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use super::{LoanEvent, LoanStream};

/// One operation queued on a fake stream.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Write(&'static str, Vec<u8>),
    Copy(&'static str, &'static str),
    Record(usize, u64),
    Wait(usize, u64),
}

/// A fake GPU: streams are queues that run only when the test steps them, events
/// count records (issued and completed), buffers are named host vectors.
#[derive(Default)]
pub(crate) struct World {
    pub(crate) streams: Vec<VecDeque<Op>>,
    recorded: Vec<u64>,
    completed: Vec<u64>,
    buffers: HashMap<&'static str, Vec<u8>>,
    pub(crate) fail_records: bool,
    pub(crate) drains: usize,
}

impl World {
    /// Runs the head of `stream` if it can run; whether it did.
    pub(crate) fn step(&mut self, stream: usize) -> bool {
        let Some(op) = self.streams[stream].front().cloned() else {
            return false;
        };
        match op {
            Op::Wait(event, generation) if self.completed[event] < generation => {
                return false;
            }
            Op::Wait(..) => {}
            Op::Record(event, generation) => {
                self.completed[event] = self.completed[event].max(generation);
            }
            Op::Write(buffer, bytes) => {
                self.buffers.insert(buffer, bytes);
            }
            Op::Copy(from, to) => {
                let bytes = self.buffers[from].clone();
                self.buffers.insert(to, bytes);
            }
        }
        self.streams[stream].pop_front();
        true
    }

    /// Steps only `streams` until none can run.
    pub(crate) fn run(&mut self, streams: &[usize]) {
        while streams.iter().any(|&s| self.step(s)) {}
    }

    pub(crate) fn run_all(&mut self) {
        let all: Vec<usize> = (0..self.streams.len()).collect();
        self.run(&all);
    }
}

#[derive(Clone)]
pub(crate) struct Gpu(pub(crate) Rc<RefCell<World>>);

pub(crate) struct Stream {
    pub(crate) gpu: Gpu,
    pub(crate) id: usize,
}

pub(crate) struct Event {
    pub(crate) gpu: Gpu,
    pub(crate) id: usize,
}

impl Gpu {
    pub(crate) fn new() -> Gpu {
        Gpu(Rc::new(RefCell::new(World::default())))
    }
    pub(crate) fn stream(&self) -> Stream {
        let mut world = self.0.borrow_mut();
        world.streams.push(VecDeque::new());
        Stream {
            gpu: self.clone(),
            id: world.streams.len() - 1,
        }
    }
    pub(crate) fn event(&self) -> Event {
        let mut world = self.0.borrow_mut();
        world.recorded.push(0);
        world.completed.push(0);
        Event {
            gpu: self.clone(),
            id: world.recorded.len() - 1,
        }
    }
    pub(crate) fn buffer(&self, name: &'static str) -> Vec<u8> {
        self.0
            .borrow()
            .buffers
            .get(name)
            .cloned()
            .unwrap_or_default()
    }
    pub(crate) fn put(&self, name: &'static str, bytes: &[u8]) {
        self.0.borrow_mut().buffers.insert(name, bytes.to_vec());
    }
    pub(crate) fn run(&self, streams: &[&Stream]) {
        let ids: Vec<usize> = streams.iter().map(|s| s.id).collect();
        self.0.borrow_mut().run(&ids);
    }
}

impl Stream {
    pub(crate) fn push(&self, op: Op) {
        self.gpu.0.borrow_mut().streams[self.id].push_back(op);
    }
    pub(crate) fn is_idle(&self) -> bool {
        self.gpu.0.borrow().streams[self.id].is_empty()
    }
}

impl Event {
    /// Whether its last record completed, without running anything (`cuEventQuery`).
    pub(crate) fn is_done(&self) -> bool {
        let world = self.gpu.0.borrow();
        world.completed[self.id] >= world.recorded[self.id]
    }
}

impl LoanEvent for Event {
    type Error = String;
    /// Runs every stream until the last record is done; an error if it never is.
    fn host_wait(&self) -> Result<(), String> {
        let mut world = self.gpu.0.borrow_mut();
        let target = world.recorded[self.id];
        world.run_all();
        if world.completed[self.id] >= target {
            Ok(())
        } else {
            Err(format!("event {} never completes: a deadlock", self.id))
        }
    }
}

impl LoanStream for Stream {
    type Error = String;
    type Event = Event;
    fn wait(&mut self, event: &Event) -> Result<(), String> {
        let generation = self.gpu.0.borrow().recorded[event.id];
        self.push(Op::Wait(event.id, generation));
        Ok(())
    }
    fn record(&mut self, event: &Event) -> Result<(), String> {
        let mut world = self.gpu.0.borrow_mut();
        if world.fail_records {
            return Err("cuEventRecord failed".into());
        }
        world.recorded[event.id] += 1;
        let generation = world.recorded[event.id];
        world.streams[self.id].push_back(Op::Record(event.id, generation));
        Ok(())
    }
    fn drain(&mut self) -> Result<(), String> {
        let mut world = self.gpu.0.borrow_mut();
        world.drains += 1;
        world.run_all();
        if world.streams[self.id].is_empty() {
            Ok(())
        } else {
            Err("the stream cannot drain".into())
        }
    }
}
