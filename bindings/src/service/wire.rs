//! Messages: a request ([`Request`]) is a [`reactor::Op`] or what the server keeps itself
//! (byte-range locks), a reply its outcome ([`Answer`]), each in postcard's compact form
//! (byte strings copied whole: `serde_bytes` on the data fields).
//!
//! # Invariants
//! - Decoding reads only the bytes given and fails cleanly on anything malformed: trailing
//!   bytes, lengths past the end, unknown variants, a walk inside a walk (refused by `Op`'s
//!   own deserializer before it recurses).
//! - An encoded message never exceeds [`ring::PAYLOAD_BYTES`]: an answer that would is sent
//!   as an EIO answer saying so.

use super::ring;
use engine::EngineError;
use reactor::{Op, Reply};
use serde::{Deserialize, Serialize};

/// What a client asks.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// An engine operation, run by the server's reactors.
    Op(Op),
    /// A byte-range lock on an inode the connection holds open (`corefs_setlk`; with `test`,
    /// `corefs_testlk`: only whether it could be taken, EAGAIN if not). The server keeps the
    /// locks, the connection owns them.
    Lock(LockRequest),
    /// The server's statistics ([`super::stats::ServerStats`]), for `corefs top`.
    ServerStats,
    /// A piece of a request too large for one message (an append or an atomic batch of more
    /// than 1 MiB): the server keeps the pieces of `id` for the connection, answering each
    /// `Reply::Done`, and at the `last` decodes their bytes, in order, as the request and
    /// serves it (a piece in a piece is refused).
    Piece(Piece),
    /// A write whose bytes are not in the message but beside it, at [`ring::DATA_AT`] in the
    /// slot ([`write_beside`] makes it of an [`Op::Write`] or [`Op::Append`]): the server
    /// copies them once, straight into the write's staging copy
    /// ([`ring::Region::stage_data`]), where a message holding them is copied out whole and
    /// its bytes copied again as it is decoded. It names its slot's bytes, so it is refused
    /// inside a [`Request::Piece`]. With `shared_at` its bytes are in the connection's
    /// buffer arena instead ([`super::arena`]): a buffer from `corefs_buf_alloc`, which the
    /// client does not copy at all.
    Write(WriteBeside),
    /// A read whose data the server puts straight into the connection's buffer arena, at
    /// `at` ([`super::arena::ClientArena::place`]), answered [`Reply::Placed`] with the bytes
    /// read: a read into a buffer from `corefs_buf_alloc`, which the client does not copy.
    Read(ReadShared),
}

/// The largest append a [`Request::Write`] may name in the connection's buffer arena: an
/// append is atomic, so it is one request, and the server's staging copy of it is bounded as
/// a request sent in pieces is (`server::PIECES_BYTES_MAX`). A write is at most
/// [`ring::DATA_BYTES_MAX`] per request wherever its bytes are (a longer one goes as several).
pub const SHARED_APPEND_BYTES_MAX: usize = 256 << 20;

/// A [`Request::Write`]'s arguments; its `len` bytes are in the slot's data area, or at
/// `shared_at` in the connection's buffer arena.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct WriteBeside {
    pub ino: u64,
    /// Ignored for an append.
    pub offset: u64,
    /// At the end of the file, atomically ([`Op::Append`]).
    pub append: bool,
    pub len: u32,
    pub shared_at: Option<u64>,
}

/// A [`Request::Read`]'s arguments: `len` bytes of `ino` at `offset`, into the arena at `at`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ReadShared {
    pub ino: u64,
    pub offset: u64,
    pub len: u32,
    pub at: u64,
}

impl ReadShared {
    /// The read the server runs (its data then goes to `at`).
    pub fn op(&self) -> Op {
        Op::Read {
            ino: self.ino,
            offset: self.offset,
            len: self.len as usize,
        }
    }
}

impl WriteBeside {
    /// The operation this is, with its bytes (`data`, staged by the server).
    pub fn op(&self, data: engine::Staged) -> Op {
        assert_eq!(
            data.len(),
            self.len as usize,
            "a write's bytes are its length"
        );
        Op::write_or_append(self.ino, self.offset, self.append, data)
    }
}

/// `op` as a [`Request::Write`] and the bytes that go beside it, when it is a write or an
/// append whose bytes fit a slot's data area; None for anything else (it goes in the
/// message, or in pieces).
pub fn write_beside(op: &Op) -> Option<(Request, &[u8])> {
    let (ino, offset, append, data) = match op {
        Op::Write { ino, offset, data } => (*ino, *offset, false, data),
        Op::Append { ino, data } => (*ino, 0, true, data),
        _ => return None,
    };
    (data.len() <= ring::DATA_BYTES_MAX).then(|| {
        let head = WriteBeside {
            ino,
            offset,
            append,
            len: data.len() as u32,
            shared_at: None,
        };
        (Request::Write(head), &data[..])
    })
}

/// One piece of an encoded request ([`Request::Piece`]); `id` names the request among the
/// connection's (each of its threads may be sending one).
#[derive(Debug, Serialize, Deserialize)]
pub struct Piece {
    pub id: u64,
    pub last: bool,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// A byte-range lock's arguments ([`Request::Lock`]).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LockRequest {
    pub ino: u64,
    pub kind: crate::locks::Kind,
    pub start: u64,
    pub len: u64,
    /// Only whether it could be taken (`corefs_testlk`).
    pub test: bool,
}

/// A request's outcome as it crosses the socket: the engine's error becomes its errno and
/// message (the client cannot rebuild the engine's error, and needs no more).
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    Ok(Reply),
    Err {
        errno: i32,
        message: String,
    },
    /// The answer to [`Request::ServerStats`].
    Server(Box<super::stats::ServerStats>),
}

/// `request`'s bytes on their own (tests): what [`encode_request_into`] writes into a slot.
#[cfg(test)]
fn encode_request(request: &Request) -> Result<Vec<u8>, EngineError> {
    let mut buf = vec![0u8; ring::PAYLOAD_BYTES];
    let len = encode_request_into(request, &mut buf).map_err(EngineError::from)?;
    buf.truncate(len);
    Ok(buf)
}

/// Encodes `request` into `buf` (a client's claimed slot), returning its length.
pub fn encode_request_into(request: &Request, buf: &mut [u8]) -> Result<usize, Unsent> {
    match postcard::to_slice(request, buf) {
        Ok(written) => Ok(written.len()),
        Err(postcard::Error::SerializeBufferFull) => Err(Unsent::TooLarge),
        Err(e) => Err(Unsent::Refused(EngineError::Invalid(format!(
            "the request cannot be encoded: {e}"
        )))),
    }
}

/// Why a request was not written into a slot.
#[derive(Debug)]
pub enum Unsent {
    /// It does not fit one message: it goes as [`Request::Piece`]s.
    TooLarge,
    Refused(EngineError),
}

impl From<Unsent> for EngineError {
    fn from(unsent: Unsent) -> EngineError {
        match unsent {
            Unsent::TooLarge => EngineError::Invalid(format!(
                "a request larger than the service's {} byte messages",
                ring::PAYLOAD_BYTES
            )),
            Unsent::Refused(e) => e,
        }
    }
}

pub fn decode_request(bytes: &[u8]) -> Result<Request, EngineError> {
    let (request, rest) = postcard::take_from_bytes::<Request>(bytes)
        .map_err(|e| EngineError::Invalid(format!("a malformed request: {e}")))?;
    if !rest.is_empty() {
        return Err(EngineError::Invalid(format!(
            "a request with {} bytes after its end",
            rest.len()
        )));
    }
    Ok(request)
}

/// An encoded answer in two parts, `head` then `data`, which together are the answer's
/// postcard bytes: a read's data is moved here, not copied, and goes into the slot once
/// ([`ring::Region::put_parts`]).
pub struct Encoded {
    pub head: Vec<u8>,
    pub data: Vec<u8>,
}

impl Encoded {
    pub fn whole(head: Vec<u8>) -> Encoded {
        Encoded {
            head,
            data: Vec::new(),
        }
    }

    /// The answer's bytes in one piece (tests; the statistics answer).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut all = self.head.clone();
        all.extend_from_slice(&self.data);
        all
    }
}

/// The first bytes of `Answer::Ok(Reply::Data(_))`: its two variant tags (postcard writes a
/// byte string as its length, a varint, then the bytes).
fn data_answer_tags() -> &'static [u8] {
    static TAGS: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TAGS.get_or_init(|| {
        let mut empty = postcard::to_stdvec(&Answer::Ok(Reply::Data(Vec::new())))
            .expect("an empty data answer encodes");
        // The empty byte string's length, 0, is one varint byte.
        assert_eq!(empty.pop(), Some(0), "a data answer ends with its length");
        empty
    })
}

pub fn encode_answer(result: Result<Reply, EngineError>) -> Encoded {
    let answer = match result {
        Ok(Reply::Data(data)) => {
            let mut head = data_answer_tags().to_vec();
            let mut len = data.len() as u64;
            loop {
                let byte = (len & 0x7f) as u8;
                len >>= 7;
                if len == 0 {
                    head.push(byte);
                    break;
                }
                head.push(byte | 0x80);
            }
            if head.len() + data.len() > ring::PAYLOAD_BYTES {
                return Encoded::whole(error_answer(
                    libc::EIO,
                    &format!(
                        "a reply of {} bytes does not fit a message",
                        head.len() + data.len()
                    ),
                ));
            }
            return Encoded { head, data };
        }
        Ok(reply) => Answer::Ok(reply),
        Err(e) => Answer::Err {
            errno: e.errno(),
            message: e.to_string(),
        },
    };
    Encoded::whole(match postcard::to_stdvec(&answer) {
        Ok(bytes) if bytes.len() <= ring::PAYLOAD_BYTES => bytes,
        Ok(bytes) => error_answer(
            libc::EIO,
            &format!("a reply of {} bytes does not fit a message", bytes.len()),
        ),
        Err(e) => error_answer(libc::EIO, &format!("the reply cannot be encoded: {e}")),
    })
}

pub fn encode_server_stats(result: Result<super::stats::ServerStats, EngineError>) -> Encoded {
    match result {
        Ok(stats) => Encoded::whole(
            match postcard::to_stdvec(&Answer::Server(Box::new(stats))) {
                Ok(bytes) if bytes.len() <= ring::PAYLOAD_BYTES => bytes,
                _ => error_answer(libc::EIO, "the server's statistics do not fit a message"),
            },
        ),
        Err(e) => encode_answer(Err(e)),
    }
}

pub fn decode_server_stats(bytes: &[u8]) -> Result<super::stats::ServerStats, EngineError> {
    match postcard::from_bytes::<Answer>(bytes) {
        Ok(Answer::Server(stats)) => Ok(*stats),
        Ok(Answer::Err { errno, message }) => Err(EngineError::Refused { errno, message }),
        Ok(Answer::Ok(reply)) => Err(EngineError::Refused {
            errno: libc::EIO,
            message: format!("statistics answered with {reply:?}"),
        }),
        Err(e) => Err(EngineError::Refused {
            errno: libc::EIO,
            message: format!("malformed statistics from the service: {e}"),
        }),
    }
}

fn error_answer(errno: i32, message: &str) -> Vec<u8> {
    postcard::to_stdvec(&Answer::Err {
        errno,
        message: message.to_string(),
    })
    .expect("an error answer encodes")
}

pub fn decode_answer(bytes: &[u8]) -> Result<Reply, EngineError> {
    match postcard::from_bytes::<Answer>(bytes) {
        Ok(Answer::Ok(reply)) => Ok(reply),
        Ok(Answer::Err { errno, message }) => Err(EngineError::Refused { errno, message }),
        Ok(Answer::Server(_)) => Err(EngineError::Refused {
            errno: libc::EIO,
            message: "statistics where a reply was due".into(),
        }),
        Err(e) => Err(EngineError::Refused {
            errno: libc::EIO,
            message: format!("a malformed reply from the service: {e}"),
        }),
    }
}

/// The bytes every answer carrying a read's data starts with (`Answer::Ok(Reply::Data)`'s
/// variant tags), before the data's length.
fn data_answer_prefix() -> &'static [u8] {
    static PREFIX: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    PREFIX.get_or_init(|| {
        let mut empty = postcard::to_allocvec(&Answer::Ok(Reply::Data(Vec::new())))
            .expect("an empty reply encodes");
        // The last byte is the empty data's length (a one-byte varint 0).
        assert_eq!(empty.pop(), Some(0), "postcard's encoding of empty bytes");
        empty
    })
}

/// Decodes the answer to a [`Request::Read`] of `len` bytes: how many the server placed.
/// An error answer is the engine's error; any other reply, or more than was asked for, EIO.
pub fn decode_placed(bytes: &[u8], len: usize) -> Result<usize, EngineError> {
    match decode_answer(bytes)? {
        Reply::Placed(n) if n <= len => Ok(n),
        other => Err(EngineError::Refused {
            errno: libc::EIO,
            message: format!("unexpected reply to a read into shared memory {other:?}"),
        }),
    }
}

/// Decodes `bytes`, the answer to a read of at most `out.len()` bytes, copying the data
/// straight from the slot into `out` (a read through the C ABI lands in the caller's buffer
/// with no copy in between); returns the bytes read. An error answer is the engine's error;
/// any other reply, data longer than `out`, or a malformed answer is EIO.
pub fn decode_read_into(bytes: &[u8], out: &mut [u8]) -> Result<usize, EngineError> {
    let malformed = |why: &str| EngineError::Refused {
        errno: libc::EIO,
        message: format!("a malformed read answer from the service: {why}"),
    };
    let Some(rest) = bytes.strip_prefix(data_answer_prefix()) else {
        return match decode_answer(bytes)? {
            Reply::Data(_) => Err(malformed("not in its canonical form")),
            other => Err(EngineError::Refused {
                errno: libc::EIO,
                message: format!("unexpected reply to a read {other:?}"),
            }),
        };
    };
    let (len, data) =
        postcard::take_from_bytes::<u64>(rest).map_err(|e| malformed(&e.to_string()))?;
    if data.len() as u64 != len {
        return Err(malformed("its length is not its data's"));
    }
    if data.len() > out.len() {
        return Err(malformed("more data than was asked for"));
    }
    out[..data.len()].copy_from_slice(data);
    Ok(data.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read's answer decodes into the caller's buffer exactly as through [`decode_answer`];
    /// errors, other replies, too much data and every truncation or extension of the bytes
    /// are refused cleanly.
    #[test]
    fn a_read_answer_decodes_into_the_callers_buffer() {
        for len in [0usize, 1, 127, 128, 300, 4096, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let bytes = postcard::to_allocvec(&Answer::Ok(Reply::Data(data.clone()))).unwrap();
            let mut out = vec![0u8; len + 5];
            assert_eq!(decode_read_into(&bytes, &mut out).unwrap(), len);
            assert_eq!(&out[..len], &data[..]);
            if len > 0 {
                let mut short = vec![0u8; len - 1];
                assert!(
                    decode_read_into(&bytes, &mut short).is_err(),
                    "{len} into less"
                );
                assert!(decode_read_into(&bytes[..bytes.len() - 1], &mut out).is_err());
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(
                decode_read_into(&longer, &mut out).is_err(),
                "{len} with a tail"
            );
        }
        let err = postcard::to_allocvec(&Answer::Err {
            errno: libc::EBADF,
            message: "no".into(),
        })
        .unwrap();
        let e = decode_read_into(&err, &mut [0u8; 8]).unwrap_err();
        assert_eq!(e.errno(), libc::EBADF);
        let other = postcard::to_allocvec(&Answer::Ok(Reply::Written(3))).unwrap();
        assert_eq!(
            decode_read_into(&other, &mut [0u8; 8]).unwrap_err().errno(),
            libc::EIO
        );
        assert!(decode_read_into(&[], &mut [0u8; 8]).is_err());
    }

    #[test]
    fn requests_and_answers_survive_the_trip_and_nested_walks_are_refused() {
        let op = Op::Walk {
            from: 1,
            path: vec![b"a".to_vec(), b"b".to_vec()],
            then: Box::new(Op::Write {
                ino: 0,
                offset: 7,
                // Large enough to be staged aligned (`nvme::staging_copy`).
                data: vec![9; nvme::shared::STAGING_ALIGNED_FROM_BYTES + 5000].into(),
            }),
        };
        let request = Request::Op(op);
        let back = decode_request(&encode_request(&request).unwrap()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{request:?}"));
        let Request::Op(op) = back else {
            unreachable!()
        };
        // A large write's bytes come out of the message aligned, for the device to write from.
        let Op::Walk { then, .. } = &op else {
            unreachable!()
        };
        let Op::Write { data, .. } = &**then else {
            unreachable!()
        };
        assert_eq!(data.as_ptr() as usize % nvme::shared::ALIGN_BYTES, 0);
        let nested = Op::Walk {
            from: 1,
            path: vec![],
            then: Box::new(op),
        };
        let nested = Request::Op(nested);
        assert!(decode_request(&postcard::to_stdvec(&nested).unwrap()).is_err());
        // A million walks deep, written by hand (encoding it would recurse): refused at the
        // second, without recursing into the rest (this test would overflow its stack).
        let mut deep = vec![0]; // Request::Op(
        for _ in 0..1_000_000 {
            deep.extend_from_slice(&[0, 1, 0]); // Walk { from: 1, path: [], then: ...
        }
        deep.push(postcard::to_stdvec(&Op::Sync).unwrap()[0]);
        assert!(decode_request(&deep).is_err());
        let mut bytes = encode_request(&Request::Op(Op::Sync)).unwrap();
        bytes.push(0);
        assert!(
            decode_request(&bytes).is_err(),
            "trailing bytes are refused"
        );
        let answer =
            decode_answer(&encode_answer(Err(EngineError::NotFound)).to_vec()).unwrap_err();
        assert_eq!(answer.errno(), libc::ENOENT);
        let data = decode_answer(&encode_answer(Ok(Reply::Data(vec![1, 2, 3]))).to_vec()).unwrap();
        assert!(matches!(data, Reply::Data(d) if d == [1, 2, 3]));
    }

    /// A data answer written in two parts is postcard's own encoding, at every length where
    /// the length's varint grows a byte, and one past a message is an EIO answer.
    #[test]
    fn a_data_answer_in_two_parts_is_postcards_encoding() {
        for len in [0usize, 1, 127, 128, 16_383, 16_384, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|k| k as u8).collect();
            let parts = encode_answer(Ok(Reply::Data(data.clone())));
            assert_eq!(
                parts.to_vec(),
                postcard::to_stdvec(&Answer::Ok(Reply::Data(data))).unwrap(),
                "{len} bytes"
            );
        }
        let too_long = encode_answer(Ok(Reply::Data(vec![0; ring::PAYLOAD_BYTES])));
        assert_eq!(
            decode_answer(&too_long.to_vec()).unwrap_err().errno(),
            libc::EIO
        );
    }

    /// Writes and appends that fit a slot's data area go beside a message naming them, and
    /// come back as the same operation; a larger one, or any other operation, does not.
    #[test]
    fn a_write_beside_its_message_is_the_same_write() {
        let data: Vec<u8> = (0..ring::DATA_BYTES_MAX).map(|i| (i * 5) as u8).collect();
        for len in [0, 1, 4096, ring::DATA_BYTES_MAX] {
            for op in [
                Op::Write {
                    ino: 7,
                    offset: 12_345,
                    data: data[..len].to_vec().into(),
                },
                Op::Append {
                    ino: 9,
                    data: data[..len].to_vec().into(),
                },
            ] {
                let (head, beside) = write_beside(&op).expect("fits beside");
                assert_eq!(beside, &data[..len]);
                let bytes = encode_request(&head).unwrap();
                assert!(
                    bytes.len() < ring::DATA_AT,
                    "the message fits before the data"
                );
                let Request::Write(back) = decode_request(&bytes).unwrap() else {
                    panic!("not a write beside its message");
                };
                let again = back.op(engine::Staged::copy_of(beside));
                assert_eq!(format!("{again:?}"), format!("{op:?}"));
            }
        }
        let long = Op::Write {
            ino: 7,
            offset: 0,
            data: vec![0; ring::DATA_BYTES_MAX + 1].into(),
        };
        assert!(write_beside(&long).is_none());
        assert!(write_beside(&Op::Sync).is_none());
    }

    #[test]
    fn random_bytes_never_panic_the_decoder() {
        let mut state = 0x9e3779b97f4a7c15u64;
        for len in 0..2000usize {
            let bytes: Vec<u8> = (0..len % 97)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = decode_request(&bytes);
            let _ = decode_answer(&bytes);
        }
    }
}
