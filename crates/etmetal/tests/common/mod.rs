pub mod gpu;
pub mod threads;
