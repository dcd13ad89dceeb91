//! The copy loop of the cma channel: moves bytes from ranges of another process into
//! local buffers with `process_vm_readv`, in as few calls as the kernel's limits allow.
//!
//! One call takes at most `IOV_MAX` (1024) iovecs per side and moves at most
//! `MAX_RW_COUNT` bytes (`INT_MAX` rounded down to a page, 0x7ffff000, the chunk size
//! TensorPipe uses). A call may also stop early (it returns how many bytes it moved,
//! for instance when a remote page is unmapped part-way), so the loop keeps a cursor
//! and resumes from it; a call that moves nothing is an error, never a spin. Local and
//! remote iovecs are built pairwise with equal lengths, so one byte count advances both
//! sides alike. The planning ([`plan_batch`], [`advance`]) is pure and tested apart from
//! the syscall. This module does not check who the peer is; the caller does.

use std::io::{self, IoSliceMut};

use crate::sys::process::{read_process_memory, RemoteRange};

/// The most bytes one `process_vm_readv` call moves (Linux's `MAX_RW_COUNT` on 4 KiB
/// pages).
pub(crate) const MAX_RW_COUNT: usize = 0x7fff_f000;
/// The most iovecs per side of one call (Linux's `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// A remote range to read and the local buffer of the same length to fill.
pub(crate) struct Piece<'a> {
    /// The remote start address.
    pub(crate) remote: u64,
    /// Where the bytes go; its length is the range's length.
    pub(crate) local: &'a mut [u8],
}

/// A position in a list of pieces: a piece index and a byte offset inside it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub(crate) piece: usize,
    pub(crate) offset: usize,
}

/// One iovec pair of a batch: `len` bytes of piece `piece`, from byte `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) piece: usize,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// The spans of the next call from `cursor`: at most `max_iov` spans and `max_bytes`
/// bytes in all; empty pieces are skipped. Empty only when nothing is left.
pub(crate) fn plan_batch(
    lengths: &[usize],
    cursor: Cursor,
    max_iov: usize,
    max_bytes: usize,
) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut total = 0usize;
    for (piece, &length) in lengths.iter().enumerate().skip(cursor.piece) {
        if spans.len() >= max_iov || total >= max_bytes {
            break;
        }
        let start = if piece == cursor.piece {
            cursor.offset.min(length)
        } else {
            0
        };
        let len = (length - start).min(max_bytes - total);
        if len == 0 {
            continue;
        }
        spans.push(Span { piece, start, len });
        total += len;
    }
    spans
}

/// The cursor after `moved` more bytes. Moving past the end stops at the end.
pub(crate) fn advance(lengths: &[usize], mut cursor: Cursor, mut moved: usize) -> Cursor {
    while let Some(&length) = lengths.get(cursor.piece) {
        let left = length.saturating_sub(cursor.offset);
        if moved < left {
            cursor.offset += moved;
            return cursor;
        }
        moved -= left;
        cursor = Cursor {
            piece: cursor.piece + 1,
            offset: 0,
        };
    }
    cursor
}

/// Why the copy loop stopped.
#[derive(Debug)]
pub(crate) struct ReadFailure {
    /// Where the failing call started.
    pub(crate) at: Cursor,
    /// What went wrong: the OS error, or `None` if a call moved no byte.
    pub(crate) source: Option<io::Error>,
}

/// Fills every piece's local buffer from process `pid`.
pub(crate) fn read_pieces(pid: libc::pid_t, pieces: &mut [Piece<'_>]) -> Result<(), ReadFailure> {
    let lengths: Vec<usize> = pieces.iter().map(|p| p.local.len()).collect();
    let mut cursor = Cursor::default();
    loop {
        let spans = plan_batch(&lengths, cursor, IOV_MAX, MAX_RW_COUNT);
        if spans.is_empty() {
            return Ok(());
        }
        // Spans name pieces in increasing order, each at most once, so walking the
        // pieces once lends each span its own disjoint borrow.
        let mut local = Vec::with_capacity(spans.len());
        let mut remote = Vec::with_capacity(spans.len());
        let mut rest = pieces.iter_mut().enumerate();
        for span in &spans {
            let piece = rest.find(|(index, _)| *index == span.piece).map(|(_, p)| p);
            let Some(piece) = piece else {
                return Err(ReadFailure {
                    at: cursor,
                    source: None,
                });
            };
            // The remote address is only a number to the kernel, which validates it
            // against the peer's mappings; wrapping is caught there (EFAULT).
            remote.push(RemoteRange {
                address: piece.remote.wrapping_add(span.start as u64),
                len: span.len,
            });
            let Some(target) = piece.local.get_mut(span.start..span.start + span.len) else {
                return Err(ReadFailure {
                    at: cursor,
                    source: None,
                });
            };
            local.push(IoSliceMut::new(target));
        }
        let moved = read_process_memory(pid, &mut local, &remote);
        drop(local);
        match moved {
            Ok(0) => {
                return Err(ReadFailure {
                    at: cursor,
                    source: None,
                })
            }
            Ok(moved) => cursor = advance(&lengths, cursor, moved),
            Err(error) => {
                return Err(ReadFailure {
                    at: cursor,
                    source: Some(error),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn batches_respect_both_limits() {
        let lengths = [10, 0, 5, 20];
        let spans = plan_batch(&lengths, Cursor::default(), 2, 100);
        assert_eq!(
            spans,
            vec![
                Span {
                    piece: 0,
                    start: 0,
                    len: 10
                },
                Span {
                    piece: 2,
                    start: 0,
                    len: 5
                }
            ]
        );
        let spans = plan_batch(&lengths, Cursor::default(), 8, 12);
        assert_eq!(spans.iter().map(|s| s.len).sum::<usize>(), 12);
        assert_eq!(spans.len(), 2);
        let spans = plan_batch(
            &lengths,
            Cursor {
                piece: 3,
                offset: 7,
            },
            8,
            100,
        );
        assert_eq!(
            spans,
            vec![Span {
                piece: 3,
                start: 7,
                len: 13
            }]
        );
        assert!(plan_batch(
            &lengths,
            Cursor {
                piece: 4,
                offset: 0
            },
            8,
            100
        )
        .is_empty());
        assert!(plan_batch(&[0, 0], Cursor::default(), 8, 100).is_empty());
    }

    #[test]
    fn a_64_gib_piece_splits_at_max_rw_count() {
        let lengths = [64usize << 30];
        let spans = plan_batch(&lengths, Cursor::default(), IOV_MAX, MAX_RW_COUNT);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans.first().map(|s| s.len), Some(MAX_RW_COUNT));
    }

    #[test]
    fn reading_this_process_fills_pieces() {
        let source: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let mut first = vec![0u8; 3000];
        let mut second = vec![0u8; 2000];
        let base = source.as_ptr() as u64;
        let mut pieces = [
            Piece {
                remote: base,
                local: &mut first,
            },
            Piece {
                remote: base + 3000,
                local: &mut second,
            },
        ];
        read_pieces(std::process::id() as libc::pid_t, &mut pieces).expect("self read");
        assert_eq!(&first[..], &source[..3000]);
        assert_eq!(&second[..], &source[3000..]);
    }

    #[test]
    fn more_pieces_than_iov_max_take_several_calls() {
        let count = IOV_MAX * 2 + 7;
        let source: Vec<u8> = (0..count).map(|i| (i % 255) as u8).collect();
        let mut targets = vec![[0u8; 1]; count];
        let base = source.as_ptr() as u64;
        let mut pieces: Vec<Piece<'_>> = targets
            .iter_mut()
            .enumerate()
            .map(|(i, target)| Piece {
                remote: base + i as u64,
                local: &mut target[..],
            })
            .collect();
        read_pieces(std::process::id() as libc::pid_t, &mut pieces).expect("self read");
        assert!(targets.iter().zip(&source).all(|(t, s)| t[0] == *s));
    }

    #[test]
    fn reading_an_unmapped_range_fails_with_efault() {
        let mut target = [0u8; 16];
        let mut pieces = [Piece {
            remote: 8,
            local: &mut target,
        }];
        let failure = read_pieces(std::process::id() as libc::pid_t, &mut pieces)
            .expect_err("address 8 is never mapped");
        assert_eq!(
            failure.source.and_then(|e| e.raw_os_error()),
            Some(libc::EFAULT)
        );
        assert_eq!(failure.at, Cursor::default());
    }

    proptest! {
        /// Driving the planner with arbitrary short reads (as the kernel may return)
        /// visits every byte exactly once, in order, and terminates.
        #[test]
        fn short_reads_cover_every_byte_once(
            lengths in proptest::collection::vec(0usize..50, 0..20),
            max_iov in 1usize..6,
            max_bytes in 1usize..64,
            shorts in proptest::collection::vec(0.0f64..1.0, 1..16),
        ) {
            let total: usize = lengths.iter().sum();
            let mut seen: Vec<(usize, usize)> = Vec::new();
            let mut cursor = Cursor::default();
            let mut step = 0usize;
            loop {
                let spans = plan_batch(&lengths, cursor, max_iov, max_bytes);
                if spans.is_empty() {
                    break;
                }
                prop_assert!(spans.len() <= max_iov);
                let planned: usize = spans.iter().map(|s| s.len).sum();
                prop_assert!(planned <= max_bytes);
                let fraction = shorts[step % shorts.len()];
                let moved = ((planned as f64 * fraction) as usize).clamp(1, planned);
                let mut left = moved;
                for span in &spans {
                    let take = span.len.min(left);
                    for i in 0..take {
                        seen.push((span.piece, span.start + i));
                    }
                    left -= take;
                }
                cursor = advance(&lengths, cursor, moved);
                step += 1;
                prop_assert!(step <= total + 1);
            }
            let expected: Vec<(usize, usize)> = lengths
                .iter()
                .enumerate()
                .flat_map(|(p, &l)| (0..l).map(move |i| (p, i)))
                .collect();
            prop_assert_eq!(seen, expected);
        }
    }
}
