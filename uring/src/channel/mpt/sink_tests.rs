//! [`MptChannel::recv_with`] over real connections, into a sink that behaves like a device
//! runtime's staging: a few buffers, each piece's "copy to the device" landing only when
//! its buffer is needed again (or at the end), so a buffer reused too early, a piece out
//! of place or a byte read twice shows up in the result.

use super::*;

fn local() -> IpAddr {
    IpAddr::from([127, 0, 0, 1])
}

/// A pair of channels over `connections` real loopback connections.
fn pair(connections: u16) -> (MptChannel, MptChannel) {
    let listener = MptListener::bind(local()).unwrap_or_else(|e| panic!("{e}"));
    let near = open_connections(listener.address(), 7, connections, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}"));
    let far = listener
        .claim(7, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}"));
    let options = MptOptions {
        min_stripe_len: 1000,
    };
    (
        MptChannel::new(near, options).unwrap_or_else(|e| panic!("{e}")),
        MptChannel::new(far, options).unwrap_or_else(|e| panic!("{e}")),
    )
}

/// A piece on its way: the buffer it is read into, and where it goes.
struct Piece {
    slot: usize,
    offset: usize,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Books {
    /// Idle buffers.
    free: Vec<usize>,
    /// Pieces whose copy is still "running", oldest first: `(slot, offset, bytes)`.
    copying: Vec<(usize, usize, Vec<u8>)>,
    /// The "device memory".
    memory: Vec<u8>,
    /// Bytes written into `memory`, to catch overlaps.
    written: usize,
    /// The most buffers handed out at once, and the connections seen.
    most_out: usize,
    takes: usize,
}

/// The staging of a fake device runtime: `slots` buffers of `piece_len` bytes.
struct Staging {
    piece_len: usize,
    slots: usize,
    books: Mutex<Books>,
    /// Signalled when a piece is given back: a lane with no idle buffer and no copy to
    /// land waits for the buffers the other lanes are reading into.
    given_back: Condvar,
    refuse_at: Option<usize>,
}

impl Staging {
    fn new(len: usize, piece_len: usize, slots: usize) -> Staging {
        Staging {
            piece_len,
            slots,
            books: Mutex::new(Books {
                free: (0..slots).collect(),
                memory: vec![0xee; len],
                ..Books::default()
            }),
            given_back: Condvar::new(),
            refuse_at: None,
        }
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lands the oldest running copy: its bytes reach the memory, its buffer is free.
    fn land_one(books: &mut Books) -> bool {
        if books.copying.is_empty() {
            return false;
        }
        let (slot, offset, bytes) = books.copying.remove(0);
        books.memory[offset..offset + bytes.len()].copy_from_slice(&bytes);
        books.written += bytes.len();
        books.free.push(slot);
        true
    }

    /// Every copy landed: the memory.
    fn finish(self) -> (Vec<u8>, Books) {
        let mut books = self
            .books
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        while Self::land_one(&mut books) {}
        (std::mem::take(&mut books.memory), books)
    }
}

impl StripeSink for Staging {
    type Piece = Piece;

    fn piece_len(&self) -> usize {
        self.piece_len
    }

    fn take(&self, offset: usize, len: usize) -> Result<Piece, String> {
        if self.refuse_at == Some(offset) {
            return Err("fake cuMemcpyHtoDAsync failed".into());
        }
        if len > self.piece_len || offset / self.piece_len != (offset + len - 1) / self.piece_len {
            return Err(format!("piece {offset}+{len} crosses a chunk"));
        }
        let mut books = self.books();
        // No idle buffer: wait for (land) the oldest copy, as a runtime waits on its event;
        // with none running, every buffer is being read into by another lane: wait for one.
        while books.free.is_empty() {
            if Self::land_one(&mut books) {
                continue;
            }
            let (next, waited) = self
                .given_back
                .wait_timeout(books, Duration::from_secs(10))
                .unwrap_or_else(PoisonError::into_inner);
            books = next;
            if waited.timed_out() && books.free.is_empty() && books.copying.is_empty() {
                return Err("every buffer is out for 10 s and no copy runs: a leak".into());
            }
        }
        let slot = books.free.pop().unwrap_or_default();
        books.takes += 1;
        let out = self.slots - books.free.len();
        books.most_out = books.most_out.max(out);
        // Stale bytes, so that a piece not read shows.
        Ok(Piece {
            slot,
            offset,
            bytes: vec![0xaa; len],
        })
    }

    fn bytes<'p>(&self, piece: &'p mut Piece) -> &'p mut [u8] {
        &mut piece.bytes
    }

    fn put(&self, piece: Piece) -> Result<(), String> {
        // The copy starts: it lands later.
        self.books()
            .copying
            .push((piece.slot, piece.offset, piece.bytes));
        self.given_back.notify_all();
        Ok(())
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn stripes_land_piece_by_piece_from_every_connection_through_few_buffers() {
    let (mut near, mut far) = pair(4);
    for (len, piece_len, slots) in [(10_000, 1024, 2), (9_999, 333, 3), (4_000, 4096, 1)] {
        let data = pattern(len);
        let staging = Staging::new(len, piece_len, slots);
        std::thread::scope(|s| {
            let sender = s.spawn(|| near.send(11, &data));
            far.recv_with(11, len, &staging)
                .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
            sender
                .join()
                .unwrap_or_else(|_| panic!("sender panicked"))
                .unwrap_or_else(|e| panic!("{e}"));
        });
        let stripes = stripes(len, 4, 1000);
        let expected_pieces: usize = stripes
            .iter()
            .map(|&stripe| pieces(stripe, piece_len).count())
            .sum();
        let (memory, books) = staging.finish();
        assert!(
            memory == data,
            "{len} bytes in pieces of {piece_len}: wrong bytes"
        );
        assert_eq!(books.written, len, "a byte landed twice or never");
        assert_eq!(books.takes, expected_pieces);
        assert!(books.most_out <= slots);
    }
}

#[test]
fn a_refused_piece_fails_the_transfer_naming_where() {
    let (mut near, mut far) = pair(2);
    let data = pattern(4000);
    let mut staging = Staging::new(4000, 1000, 2);
    staging.refuse_at = Some(3000);
    let err = std::thread::scope(|s| {
        let sender = s.spawn(|| near.send(3, &data));
        let err = far.recv_with(3, 4000, &staging).expect_err("refused");
        // The sender finishes writing (the socket buffers hold a few KiB).
        let _ = sender.join();
        err
    })
    .to_string();
    assert!(
        err.contains("bytes 3000..4000 of transfer 3") && err.contains("cuMemcpyHtoDAsync"),
        "{err}"
    );
}
