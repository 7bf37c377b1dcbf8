//! Elsewhere than Linux: every call answers [`ShmError::Unsupported`].

use crate::ShmError;

/// Never constructed on this OS.
pub struct Mapping {
    never: std::convert::Infallible,
}

impl Mapping {
    pub fn open(key: &str, _len: usize) -> Result<Mapping, ShmError> {
        crate::file_name(key)?;
        Err(ShmError::Unsupported)
    }

    pub fn addr(&self) -> usize {
        match self.never {}
    }

    pub fn identity(&self) -> (u64, u64) {
        match self.never {}
    }

    pub fn len(&self) -> usize {
        match self.never {}
    }

    pub fn is_empty(&self) -> bool {
        match self.never {}
    }

    pub fn damaged(&self) -> bool {
        match self.never {}
    }

    pub fn check(&self) -> Result<(), ShmError> {
        match self.never {}
    }

    pub fn read(&self, _offset: usize, _dst: &mut [u8]) -> Result<(), ShmError> {
        match self.never {}
    }

    pub fn write(&self, _offset: usize, _src: &[u8]) -> Result<(), ShmError> {
        match self.never {}
    }
}

pub fn install_sigbus_guard() -> Result<(), ShmError> {
    Err(ShmError::Unsupported)
}
