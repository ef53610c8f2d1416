//! corefs as a storage service: one process (`corefs serve`, [`server`]) owns the device, its
//! reactors and the commit coordinator; other processes connect over a Unix socket
//! (`corefs_connect`, or the device string `serve:PATH`) and use the same C ABI, their calls
//! carried over shared memory ([`ring`]) as the reactor operations the in-process library
//! sends its reactors ([`reactor::Op`], encoded by [`wire`]). Buffers from `corefs_buf_alloc`
//! live in a memory area each server maps too ([`arena`]): their bytes cross without a copy
//! on the client's side.
//!
//! # The split
//! The client library keeps what is the caller's own: path parsing, its handle table, its
//! atomic batches' staging. What reaches the device goes as one `Op` per call (a path of
//! plain names is still one request: the server walks it). The server keeps what must not be
//! left to a client: whose request it is (the socket's peer credentials, taken at connect),
//! whether that user may do it ([`access`]), which inodes the connection holds open and for
//! what, and releasing them when the client goes.
//!
//! # Trust boundary
//! Nothing a client writes is believed: a message is copied out of shared memory before it
//! is decoded, decoding is bounded by the message (no nesting beyond one walk, lengths checked
//! against what is there), every read, write and fsync must name an inode the connection
//! opened for it, sizes are capped to what a reply slot holds, and the owner of what a
//! non-root client creates is the client's uid and gid whatever the request said. A client
//! can hurt its own requests, never the server or another client's data.
//!
//! # Failure
//! A client that exits, or is killed, closes its socket: the server's watcher sees it, lets
//! the connection's workers finish what they took, and releases every inode the connection
//! still held (so its open-unlinked files go). A server that exits, or is killed, closes its
//! end: a client waiting on a slot looks at the socket at least every
//! [`client::LIVENESS_CHECK`] and then fails that call and every later one with ENOTCONN.

pub(crate) mod access;
pub mod arena;
pub(crate) mod client;
pub use client::Observer;
#[doc(hidden)]
pub use client::{connect_raw, RawConnection};
pub use wire::Answer;
pub mod ring;
pub mod server;
mod socket;
pub mod stats;
pub mod wire;
