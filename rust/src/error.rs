//! The one error type of the crate; `python.rs` raises each variant as the `remat.errors` class
//! registered for it.

/// Everything that can go wrong while reading, simulating or planning.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The graph file is malformed.
    #[error("invalid graph: {0}")]
    Graph(String),
    /// A schedule is malformed or invalid for its graph.
    #[error("invalid schedule: {0}")]
    Schedule(String),
    /// No schedule keeps activation memory within `budget`; `min_budget` is the smallest one found.
    #[error("budget of {budget} bytes is infeasible: the smallest feasible budget is {min_budget} bytes")]
    Infeasible { budget: u64, min_budget: u64 },
    /// A bad argument (a budget, a solver's name or setting); the message says what is allowed.
    #[error("{0}")]
    Argument(String),
    /// The solver failed for a reason other than an infeasible budget.
    #[error("solver failed: {0}")]
    Solver(String),
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
