//! `remat-plan GRAPH.json BUDGET [--solver rockmate|rotor|checkmate] [--time-limit SECONDS]
//! [--mip-gap GAP] [--slots N] [--quick]`
//!
//! Reads a graph file (`docs/formats.md`), plans it under BUDGET (bytes with a unit or not, or a
//! fraction in (0, 1] of plain PyTorch's peak: [`Budget`]) and prints the schedule as JSON. The
//! crate without Python.

use remat::{budget_range, plan, Budget, Graph, PlanOptions, Solver};
use std::process::ExitCode;

const USAGE: &str = "usage: remat-plan GRAPH.json BUDGET [--solver rockmate|rotor|checkmate] \
                     [--time-limit SECONDS] [--mip-gap GAP] [--slots N] [--quick]\n\
                     BUDGET: bytes (300000, 512MiB, 2GiB, 1.5GB), or a fraction in (0, 1] of plain PyTorch's peak";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(schedule) => {
            println!("{schedule}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("remat-plan: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<String, String> {
    let mut positional = Vec::new();
    let mut options = PlanOptions::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--solver" => {
                let name = it
                    .next()
                    .ok_or_else(|| format!("--solver needs a name\n{USAGE}"))?;
                options.solver = Solver::from_name(name).map_err(|e| e.to_string())?;
            }
            "--time-limit" => options.time_limit = number(it.next(), arg)?,
            "--mip-gap" => options.mip_gap = number(it.next(), arg)?,
            "--slots" => {
                options.slots = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("--slots needs a whole number\n{USAGE}"))?;
            }
            "--quick" => options.quick = true,
            "-h" | "--help" => return Err(USAGE.to_string()),
            _ => positional.push(arg.as_str()),
        }
    }
    let [path, budget] = positional[..] else {
        return Err(USAGE.to_string());
    };
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let graph = Graph::from_json(&text).map_err(|e| e.to_string())?;
    let budget = Budget::parse(budget).map_err(|e| e.to_string())?;
    let budget = match budget {
        Budget::Bytes(b) => b,
        Budget::Fraction(_) => budget.bytes(budget_range(&graph).map_err(|e| e.to_string())?.1),
    };
    let schedule = plan(&graph, budget, &options).map_err(|e| e.to_string())?;
    Ok(schedule.to_json())
}

fn number(value: Option<&String>, flag: &str) -> Result<f64, String> {
    value
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{flag} needs a number\n{USAGE}"))
}
