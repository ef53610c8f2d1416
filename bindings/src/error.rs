//! The error a C ABI call returns: an errno for the caller and a message for
//! `corefs_last_error()`.

use engine::EngineError;

/// An error on its way to C: the errno and a message.
#[derive(Debug)]
pub(crate) struct Error {
    pub errno: i32,
    pub message: String,
}

impl Error {
    pub fn new(errno: i32, message: String) -> Error {
        Error { errno, message }
    }
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Error {
        Error::new(e.errno(), e.to_string())
    }
}
