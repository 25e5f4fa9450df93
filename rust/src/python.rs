//! `remat._core`: JSON strings in and out; the GIL is released while planning. Only converts
//! types: every decision is made by the Rust API.

use crate::{Budget, Chain, Error, Graph, PlanOptions, Schedule, Solver};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `plan(graph_json, budget, solver="rockmate", time_limit=30.0, mip_gap=0.01, slots=500) -> str`:
/// the schedule JSON.
#[pyfunction]
#[pyo3(name = "plan", signature = (graph_json, budget, solver = "rockmate", time_limit = 30.0, mip_gap = 0.01, slots = crate::solve::dp::DEFAULT_SLOTS))]
fn py_plan(
    py: Python<'_>,
    graph_json: String,
    budget: u64,
    solver: &str,
    time_limit: f64,
    mip_gap: f64,
    slots: usize,
) -> PyResult<String> {
    let options = plan_options(py, solver, time_limit, mip_gap, slots)?;
    py.detach(|| {
        let graph = Graph::from_json(&graph_json)?;
        crate::plan(&graph, budget, &options).map(|s| s.to_json())
    })
    .map_err(|e| to_py_err(py, e))
}

/// `stages(graph_json, solver="rockmate", time_limit=30.0, mip_gap=0.01, slots=500) -> str`: the
/// simplified graph, the blocks and their classes with their options, as JSON.
#[pyfunction]
#[pyo3(name = "stages", signature = (graph_json, solver = "rockmate", time_limit = 30.0, mip_gap = 0.01, slots = crate::solve::dp::DEFAULT_SLOTS))]
fn py_stages(
    py: Python<'_>,
    graph_json: String,
    solver: &str,
    time_limit: f64,
    mip_gap: f64,
    slots: usize,
) -> PyResult<String> {
    let options = plan_options(py, solver, time_limit, mip_gap, slots)?;
    py.detach(|| {
        let graph = Graph::from_json(&graph_json)?;
        let stages = crate::stages::stages(&graph, &options)?;
        Ok(serde_json::to_string(&stages).expect("stages always serialize"))
    })
    .map_err(|e| to_py_err(py, e))
}

/// `simulate(graph_json, schedule_json) -> str`: the report JSON.
#[pyfunction]
#[pyo3(name = "simulate")]
fn py_simulate(py: Python<'_>, graph_json: String, schedule_json: String) -> PyResult<String> {
    py.detach(|| {
        let graph = Graph::from_json(&graph_json)?;
        let schedule = Schedule::from_json(&schedule_json)?;
        let report = crate::simulate(&graph, &schedule)?;
        Ok(serde_json::to_string(&report).expect("a report always serializes"))
    })
    .map_err(|e| to_py_err(py, e))
}

/// `memory_curve(graph_json, schedule_json=None) -> str`: the replay's points as JSON, op by op;
/// without a schedule, plain PyTorch's.
#[pyfunction]
#[pyo3(name = "memory_curve", signature = (graph_json, schedule_json=None))]
fn py_memory_curve(
    py: Python<'_>,
    graph_json: String,
    schedule_json: Option<String>,
) -> PyResult<String> {
    py.detach(|| {
        let graph = Graph::from_json(&graph_json)?;
        let schedule = match schedule_json {
            Some(json) => Schedule::from_json(&json)?,
            None => crate::solve::plan::store_all(&graph)?,
        };
        let points = crate::memory_curve(&graph, &schedule)?;
        Ok(serde_json::to_string(&points).expect("a curve always serializes"))
    })
    .map_err(|e| to_py_err(py, e))
}

/// A budget argument from Python: bytes (an int) or a fraction (a float).
#[derive(FromPyObject)]
enum BudgetArg {
    Bytes(u64),
    Fraction(f64),
}

/// `budget_bytes(budget, plain_peak) -> int`: bytes stay bytes, a fraction in (0, 1] is of
/// `plain_peak`; anything else is a `ValueError` saying what a budget is.
#[pyfunction]
#[pyo3(name = "budget_bytes")]
fn py_budget_bytes(py: Python<'_>, budget: BudgetArg, plain_peak: u64) -> PyResult<u64> {
    let budget = match budget {
        BudgetArg::Bytes(b) => Ok(Budget::Bytes(b)),
        BudgetArg::Fraction(f) => Budget::fraction(f),
    };
    budget
        .map(|b| b.bytes(plain_peak))
        .map_err(|e| to_py_err(py, e))
}

/// `parse_budget(text) -> int | float`: `"2GiB"` is bytes, `"0.4"` a fraction.
#[pyfunction]
#[pyo3(name = "parse_budget")]
fn py_parse_budget(py: Python<'_>, text: &str) -> PyResult<Py<PyAny>> {
    match Budget::parse(text).map_err(|e| to_py_err(py, e))? {
        Budget::Bytes(b) => Ok(b.into_pyobject(py)?.into_any().unbind()),
        Budget::Fraction(f) => Ok(f.into_pyobject(py)?.into_any().unbind()),
    }
}

/// `budget_range(graph_json) -> (min_budget, plain_peak)`.
#[pyfunction]
#[pyo3(name = "budget_range")]
fn py_budget_range(py: Python<'_>, graph_json: String) -> PyResult<(u64, u64)> {
    py.detach(|| crate::budget_range(&Graph::from_json(&graph_json)?))
        .map_err(|e| to_py_err(py, e))
}

/// `chain_plan(chain_json, mem_limit, slots=500) -> str`: rotor's DP; the chain sequence JSON.
#[pyfunction]
#[pyo3(name = "chain_plan", signature = (chain_json, mem_limit, slots = crate::solve::dp::DEFAULT_SLOTS))]
fn py_chain_plan(
    py: Python<'_>,
    chain_json: String,
    mem_limit: u64,
    slots: usize,
) -> PyResult<String> {
    py.detach(|| {
        let chain = Chain::from_json(&chain_json)?;
        crate::solve::dp::solve(&chain, mem_limit, slots).map(|s| s.to_json())
    })
    .map_err(|e| to_py_err(py, e))
}

/// `chain_limits(chain_json, slots=500) -> (min_limit, plain_peak)`.
#[pyfunction]
#[pyo3(name = "chain_limits", signature = (chain_json, slots = crate::solve::dp::DEFAULT_SLOTS))]
fn py_chain_limits(py: Python<'_>, chain_json: String, slots: usize) -> PyResult<(u64, u64)> {
    py.detach(|| crate::solve::dp::limits(&Chain::from_json(&chain_json)?, slots))
        .map_err(|e| to_py_err(py, e))
}

/// The solver settings of `plan` and `stages`.
fn plan_options(
    py: Python<'_>,
    solver: &str,
    time_limit: f64,
    mip_gap: f64,
    slots: usize,
) -> PyResult<PlanOptions> {
    let solver = Solver::from_name(solver).map_err(|e| to_py_err(py, e))?;
    Ok(PlanOptions {
        solver,
        time_limit,
        mip_gap,
        slots,
    })
}

/// The `remat.errors` exception for `err` (`ValueError` if that module cannot be imported).
fn to_py_err(py: Python<'_>, err: Error) -> PyErr {
    let raised = py.import("remat.errors").and_then(|errors| {
        let instance = match &err {
            Error::Graph(msg) => errors.getattr("GraphError")?.call1((msg.as_str(),))?,
            Error::Schedule(msg) => errors.getattr("ScheduleError")?.call1((msg.as_str(),))?,
            Error::Solver(msg) => errors.getattr("SolverError")?.call1((msg.as_str(),))?,
            Error::Budget(msg) => return Ok(PyValueError::new_err(msg.clone())),
            Error::Infeasible { budget, min_budget } => errors
                .getattr("InfeasibleBudget")?
                .call1((*budget, *min_budget))?,
        };
        Ok(PyErr::from_value(instance))
    });
    raised.unwrap_or_else(|_| PyValueError::new_err(err.to_string()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_plan, m)?)?;
    m.add_function(wrap_pyfunction!(py_simulate, m)?)?;
    m.add_function(wrap_pyfunction!(py_memory_curve, m)?)?;
    m.add_function(wrap_pyfunction!(py_stages, m)?)?;
    m.add_function(wrap_pyfunction!(py_budget_range, m)?)?;
    m.add_function(wrap_pyfunction!(py_budget_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(py_parse_budget, m)?)?;
    m.add_function(wrap_pyfunction!(py_chain_plan, m)?)?;
    m.add_function(wrap_pyfunction!(py_chain_limits, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
