pub mod gpu;
pub mod graphs;
pub mod threads;
