//! One error type for every crate. Each error has a kind (which decides the
//! CLI exit code: bad input is 2, internal failure 1) and a message that names
//! what is wrong and where; callers add context as the error travels up.

use std::fmt;

/// What class of failure this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Reading or writing a file failed.
    Io,
    /// A file is malformed: truncated, wrong magic, out-of-range index, …
    Format,
    /// Valid input that etmetal does not support (an op, a dtype, dynamic shapes).
    Unsupported,
    /// Wrong inputs at run time: count, dtype or shape.
    InvalidInput,
    /// A shape or dtype in the program disagrees with what an op produces.
    Shape,
    /// A resource limit (memory, device limits) would be exceeded.
    Limit,
    /// A bug in etmetal or a failure of the device.
    Internal,
}

#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// Outermost context first ("loading m.pt2", "node add_3", …).
    context: Vec<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            context: Vec::new(),
            source: None,
        }
    }
    pub fn format(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Format, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unsupported, message)
    }
    pub fn invalid_input(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidInput, message)
    }
    pub fn shape(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Shape, message)
    }
    pub fn limit(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Limit, message)
    }
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
    }
    pub fn io(path: impl fmt::Display, source: std::io::Error) -> Error {
        let mut e = Error::new(ErrorKind::Io, format!("{path}: {source}"));
        e.source = Some(Box::new(source));
        e
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Prepend a piece of context ("in node `add_1`").
    pub fn context(mut self, context: impl Into<String>) -> Error {
        self.context.insert(0, context.into());
        self
    }

    /// True when the user's input (file, arguments, tensors) is at fault.
    pub fn is_user_error(&self) -> bool {
        !matches!(self.kind, ErrorKind::Internal)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.context {
            write!(f, "{c}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Add context to any `Result<_, Error>`.
pub trait ResultExt<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;
    fn with_context<C: Into<String>>(self, f: impl FnOnce() -> C) -> Result<T>;
}

impl<T> ResultExt<T> for Result<T> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.context(context))
    }
    fn with_context<C: Into<String>>(self, f: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| e.context(f()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_reads_outside_in() {
        let e = Error::format("bad magic")
            .context("header")
            .context("m.pte");
        assert_eq!(e.to_string(), "m.pte: header: bad magic");
        assert_eq!(e.kind(), ErrorKind::Format);
        assert!(e.is_user_error());
        assert!(!Error::internal("x").is_user_error());
    }
}
