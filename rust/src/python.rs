//! `remat._core`: JSON strings in and out, or a `Graph` handle parsed once; the GIL is released
//! while parsing and planning. Only converts types: every decision is made by the Rust API.

use crate::{Budget, Chain, Error, Graph, PlanOptions, Schedule, Solver};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

/// `Graph(graph_json)`: a parsed and validated graph kept in Rust, so that plans, stages and
/// simulations reuse it.
#[pyclass(name = "Graph", module = "remat._core", frozen)]
struct PyGraph {
    graph: Graph,
}

#[pymethods]
impl PyGraph {
    #[new]
    fn new(py: Python<'_>, graph_json: &str) -> PyResult<Self> {
        let graph = parse_graph(py, graph_json)?;
        Ok(PyGraph { graph })
    }

    /// `plan(budget, options) -> str`: the schedule JSON (`options`: the solver's settings, read
    /// from their attributes).
    fn plan(&self, py: Python<'_>, budget: u64, options: OptionsArg) -> PyResult<String> {
        let options = options.checked(py)?;
        py.detach(|| crate::plan(&self.graph, budget, &options).map(|s| s.to_json()))
            .map_err(|e| to_py_err(py, e))
    }

    /// `stages(options) -> str`: the simplified graph, the blocks and their classes with their
    /// options, as JSON.
    fn stages(&self, py: Python<'_>, options: OptionsArg) -> PyResult<String> {
        let options = options.checked(py)?;
        py.detach(|| {
            let stages = crate::stages(&self.graph, &options)?;
            Ok(serde_json::to_string(&stages).expect("stages always serialize"))
        })
        .map_err(|e| to_py_err(py, e))
    }

    /// `simulate(schedule_json) -> str`: the report JSON.
    fn simulate(&self, py: Python<'_>, schedule_json: &str) -> PyResult<String> {
        py.detach(|| {
            let schedule = Schedule::from_json(schedule_json)?;
            let report = crate::simulate(&self.graph, &schedule)?;
            Ok(serde_json::to_string(&report).expect("a report always serializes"))
        })
        .map_err(|e| to_py_err(py, e))
    }

    /// `memory_curve(schedule_json=None) -> str`: the replay's points as JSON, op by op; without a
    /// schedule, plain PyTorch's.
    #[pyo3(signature = (schedule_json=None))]
    fn memory_curve(&self, py: Python<'_>, schedule_json: Option<&str>) -> PyResult<String> {
        py.detach(|| {
            let schedule = match schedule_json {
                Some(json) => Schedule::from_json(json)?,
                None => crate::store_all(&self.graph)?,
            };
            let points = crate::memory_curve(&self.graph, &schedule)?;
            Ok(serde_json::to_string(&points).expect("a curve always serializes"))
        })
        .map_err(|e| to_py_err(py, e))
    }

    /// `budget_range() -> (min_budget, plain_peak)`.
    fn budget_range(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        py.detach(|| crate::budget_range(&self.graph))
            .map_err(|e| to_py_err(py, e))
    }

    /// `plain_peak() -> int`: plain PyTorch's peak (the second of `budget_range`, without the
    /// keep-nothing schedule's replay that the first takes).
    fn plain_peak(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| crate::store_all(&self.graph))
            .map(|s| s.predicted.expect("store_all simulates").peak_bytes)
            .map_err(|e| to_py_err(py, e))
    }

    /// `to_json() -> str`: the graph file text.
    fn to_json(&self, py: Python<'_>) -> String {
        py.detach(|| self.graph.to_json())
    }
}

/// The graph in `graph_json`, parsed with the GIL released.
fn parse_graph(py: Python<'_>, graph_json: &str) -> PyResult<Graph> {
    py.detach(|| Graph::from_json(graph_json))
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

/// `chain_plan(chain_json, mem_limit, slots) -> str`: rotor's DP; the chain sequence JSON.
#[pyfunction]
#[pyo3(name = "chain_plan")]
fn py_chain_plan(
    py: Python<'_>,
    chain_json: String,
    mem_limit: u64,
    slots: usize,
) -> PyResult<String> {
    py.detach(|| {
        let chain = Chain::from_json(&chain_json)?;
        crate::plan_chain(&chain, mem_limit, slots).map(|s| s.to_json())
    })
    .map_err(|e| to_py_err(py, e))
}

/// `chain_limits(chain_json, slots) -> (min_limit, plain_peak)`.
#[pyfunction]
#[pyo3(name = "chain_limits")]
fn py_chain_limits(py: Python<'_>, chain_json: String, slots: usize) -> PyResult<(u64, u64)> {
    py.detach(|| crate::chain_limits(&Chain::from_json(&chain_json)?, slots))
        .map_err(|e| to_py_err(py, e))
}

/// `check_options(options)`: raises `remat.ArgumentError` saying what is allowed where a setting
/// is bad.
#[pyfunction]
#[pyo3(name = "check_options")]
fn py_check_options(py: Python<'_>, options: OptionsArg) -> PyResult<()> {
    options.checked(py).map(|_| ())
}

/// `default_options() -> dict`: the solver's settings where a caller gives none, the one place
/// they are written ([`PlanOptions::default`]).
#[pyfunction]
#[pyo3(name = "default_options")]
fn py_default_options(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PlanOptions::default();
    let out = PyDict::new(py);
    out.set_item("solver", d.solver.name())?;
    out.set_item("time_limit", d.time_limit)?;
    out.set_item("mip_gap", d.mip_gap)?;
    out.set_item("slots", d.slots)?;
    out.set_item("quick", d.quick)?;
    Ok(out)
}

/// The solver's settings as one object (`remat.planner.SolverOptions`), read from its
/// attributes.
#[derive(FromPyObject)]
struct OptionsArg {
    #[pyo3(attribute)]
    solver: String,
    #[pyo3(attribute)]
    time_limit: f64,
    #[pyo3(attribute)]
    mip_gap: f64,
    #[pyo3(attribute)]
    slots: usize,
    #[pyo3(attribute)]
    quick: bool,
}

impl OptionsArg {
    /// The settings, checked ([`PlanOptions::check`]).
    fn checked(self, py: Python<'_>) -> PyResult<PlanOptions> {
        let solver = Solver::from_name(&self.solver).map_err(|e| to_py_err(py, e))?;
        let options = PlanOptions {
            solver,
            time_limit: self.time_limit,
            mip_gap: self.mip_gap,
            slots: self.slots,
            quick: self.quick,
        };
        options.check().map_err(|e| to_py_err(py, e))?;
        Ok(options)
    }
}

/// remat's exception classes, one per [`Error`] variant, registered once by `remat.errors`.
struct ErrorClasses {
    graph: Py<PyType>,
    schedule: Py<PyType>,
    infeasible: Py<PyType>,
    argument: Py<PyType>,
    solver: Py<PyType>,
}

static ERROR_CLASSES: PyOnceLock<ErrorClasses> = PyOnceLock::new();

/// `register_errors(graph, schedule, infeasible, argument, solver)`: the classes each Rust error
/// is raised as (called once, by `remat.errors`).
#[pyfunction]
#[pyo3(name = "register_errors")]
fn py_register_errors(
    py: Python<'_>,
    graph: Py<PyType>,
    schedule: Py<PyType>,
    infeasible: Py<PyType>,
    argument: Py<PyType>,
    solver: Py<PyType>,
) {
    let classes = ErrorClasses {
        graph,
        schedule,
        infeasible,
        argument,
        solver,
    };
    // A second registration (a reloaded `remat.errors`) keeps the first classes.
    let _ = ERROR_CLASSES.set(py, classes);
}

/// The registered `remat.errors` exception for `err`.
fn to_py_err(py: Python<'_>, err: Error) -> PyErr {
    let Some(classes) = ERROR_CLASSES.get(py) else {
        return PyRuntimeError::new_err(format!(
            "{err} (remat._core was loaded without remat.errors: import remat first)"
        ));
    };
    let raised = match &err {
        Error::Graph(msg) => classes.graph.bind(py).call1((msg.as_str(),)),
        Error::Schedule(msg) => classes.schedule.bind(py).call1((msg.as_str(),)),
        Error::Argument(msg) => classes.argument.bind(py).call1((msg.as_str(),)),
        Error::Solver(msg) => classes.solver.bind(py).call1((msg.as_str(),)),
        Error::Infeasible { budget, min_budget } => {
            classes.infeasible.bind(py).call1((*budget, *min_budget))
        }
    };
    match raised {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_budget_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(py_parse_budget, m)?)?;
    m.add_function(wrap_pyfunction!(py_chain_plan, m)?)?;
    m.add_function(wrap_pyfunction!(py_chain_limits, m)?)?;
    m.add_function(wrap_pyfunction!(py_check_options, m)?)?;
    m.add_function(wrap_pyfunction!(py_default_options, m)?)?;
    m.add_function(wrap_pyfunction!(py_register_errors, m)?)?;
    m.add_class::<PyGraph>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
