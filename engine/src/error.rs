//! Engine errors. Every error that comes from the disk says what and where; POSIX-facing
//! errors map to one errno each ([`EngineError::errno`]).

use nvme::DevError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("device error: {0}")]
    Device(#[from] DevError),
    #[error("corrupt {what} at {place} {block}: {why}")]
    Corrupt {
        what: &'static str,
        /// Where: a block address, or for an item-level fault the inode it belongs to
        /// (`place` says which).
        block: u64,
        place: &'static str,
        why: String,
    },
    #[error("no space left on device")]
    NoSpace,
    #[error("the filesystem is read-only after an earlier failure: {0}")]
    ReadOnly(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no such file or directory")]
    NotFound,
    /// What no one may do (EPERM), as a hard link to a directory.
    #[error("operation not permitted: {0}")]
    NotPermitted(String),
    /// The call would have to follow a symbolic link, which corefs never does (ELOOP, as
    /// open(2) with O_NOFOLLOW answers for one).
    #[error("a symbolic link (corefs never follows one)")]
    SymlinkNotFollowed,
    /// A mode of an operation the engine does not implement (EOPNOTSUPP), as fallocate's
    /// hole punch that would change the size.
    #[error("operation not supported: {0}")]
    NotSupported(String),
    #[error("file exists")]
    Exists,
    #[error("directory not empty")]
    NotEmpty,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("name longer than 255 bytes")]
    NameTooLong,
    #[error("no such attribute")]
    NoData,
    #[error("value too large for this filesystem ({0})")]
    TooBig(String),
    #[error("too many links")]
    TooManyLinks,
    #[error("xattr value of {0} bytes is larger than the 65536 Linux allows")]
    XattrTooLarge(usize),
    /// A bug met at run time (a reactor that panicked): the operation's outcome is unknown
    /// and the filesystem serving it has stopped (fail-stop), as after a device error.
    #[error("internal error: {0}")]
    Internal(String),
    /// An error whose errno is all there is to it: what a storage service answered its
    /// client with (the client cannot take it apart further), or a permission the service
    /// refused (EACCES, EPERM).
    #[error("{message}")]
    Refused { errno: i32, message: String },
    /// A deferred lookup needs a tree node from the device ([`crate::fetch`]): exists only
    /// inside [`crate::Filesystem::without_waiting`], which never returns it.
    #[error("a tree node must be read from the device first")]
    WouldBlock,
}

impl EngineError {
    pub fn corrupt(what: &'static str, block: u64, why: impl Into<String>) -> Self {
        EngineError::Corrupt {
            what,
            block,
            place: "block",
            why: why.into(),
        }
    }

    /// Corruption found in the items of inode `ino` (not in one block's encoding).
    pub fn corrupt_inode(what: &'static str, ino: u64, why: impl Into<String>) -> Self {
        EngineError::Corrupt {
            what,
            block: ino,
            place: "inode",
            why: why.into(),
        }
    }

    /// The errno a POSIX caller sees.
    pub fn errno(&self) -> i32 {
        match self {
            // Another writer holds the device: the open was refused, nothing failed.
            EngineError::Device(DevError::Busy { .. }) => 16, // EBUSY
            EngineError::Device(_) => libc_eio(),
            EngineError::Corrupt { .. } => 117, // EUCLEAN, as btrfs and ext4 report corruption
            EngineError::NoSpace => 28,         // ENOSPC
            EngineError::ReadOnly(_) => 30,     // EROFS
            EngineError::Invalid(_) => 22,      // EINVAL
            EngineError::NotFound => 2,         // ENOENT
            EngineError::NotPermitted(_) => 1,  // EPERM
            EngineError::NotSupported(_) => 95, // EOPNOTSUPP
            EngineError::SymlinkNotFollowed => 40, // ELOOP
            EngineError::Exists => 17,          // EEXIST
            EngineError::NotEmpty => 39,        // ENOTEMPTY
            EngineError::NotDir => 20,          // ENOTDIR
            EngineError::IsDir => 21,           // EISDIR
            EngineError::NameTooLong => 36,     // ENAMETOOLONG
            EngineError::NoData => 61,          // ENODATA
            EngineError::TooBig(_) => 27,       // EFBIG
            EngineError::TooManyLinks => 31,    // EMLINK
            EngineError::XattrTooLarge(_) => 7, // E2BIG
            EngineError::Internal(_) => libc_eio(),
            EngineError::Refused { errno, .. } => *errno,
            EngineError::WouldBlock => 11, // EAGAIN; never returned to a caller
        }
    }
}

const fn libc_eio() -> i32 {
    5
}

pub type Result<T> = std::result::Result<T, EngineError>;
