//! The solvers: plain PyTorch's and the keep-nothing plans ([`baseline`]), Checkmate's
//! whole-graph ILP ([`ilp`]), rotor's DP over a chain of blocks ([`dp`]) and Rockmate's
//! hierarchy over it ([`rockmate`]), tied together by [`plan`].

pub mod baseline;
pub mod dp;
pub mod ilp;
pub mod plan;
pub mod rockmate;
