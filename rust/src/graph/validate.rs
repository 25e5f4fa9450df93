//! Checks of a graph file; each returns a message naming what is wrong, where.

use super::{Node, Output, OutputKind, Phase, Value, ValueKind};

type Check = std::result::Result<(), String>;

pub(super) fn check_graph(values: &[Value], nodes: &[Node], outputs: &[Output]) -> Check {
    check_value_ids(values)?;
    check_aliases(values)?;
    check_node_ids_and_times(nodes)?;
    check_dataflow(values, nodes)?;
    check_outputs(values, nodes, outputs)?;
    check_donors(values, nodes, outputs)
}

fn check_value_ids(values: &[Value]) -> Check {
    for (i, v) in values.iter().enumerate() {
        if v.id != i {
            return Err(format!(
                "value #{i} ({}) has id {}: ids must be 0..n in order",
                v.name, v.id
            ));
        }
    }
    Ok(())
}

fn check_aliases(values: &[Value]) -> Check {
    for v in values {
        let Some(owner) = v.alias_of else { continue };
        let Some(o) = values.get(owner) else {
            return Err(format!(
                "value {} ({}) is an alias of unknown value {owner}",
                v.id, v.name
            ));
        };
        if owner == v.id || o.alias_of.is_some() {
            return Err(format!(
                "value {} ({}) is an alias of {} ({}), which is not a storage owner",
                v.id, v.name, o.id, o.name
            ));
        }
        if v.bytes != 0 {
            return Err(format!(
                "value {} ({}) is an alias but has {} bytes (must be 0)",
                v.id, v.name, v.bytes
            ));
        }
        let kinds_ok = match v.kind {
            ValueKind::Activation => true,
            ValueKind::Tangent => false,
            _ => o.kind.is_graph_input(),
        };
        if !kinds_ok {
            return Err(format!(
                "value {} ({}) of kind {:?} cannot alias {} ({}) of kind {:?}",
                v.id, v.name, v.kind, o.id, o.name, o.kind
            ));
        }
    }
    Ok(())
}

fn check_node_ids_and_times(nodes: &[Node]) -> Check {
    let mut seen_backward = false;
    for (i, n) in nodes.iter().enumerate() {
        if n.id != i {
            return Err(format!(
                "node #{i} ({}) has id {}: ids must be 0..n in order",
                n.name, n.id
            ));
        }
        if !(n.time.is_finite() && n.time >= 0.0) {
            return Err(format!(
                "node {i} ({}) has time {}: must be finite and >= 0",
                n.name, n.time
            ));
        }
        match n.phase {
            Phase::Backward => seen_backward = true,
            Phase::Forward if seen_backward => {
                return Err(format!(
                    "forward node {i} ({}) comes after a backward node",
                    n.name
                ));
            }
            Phase::Forward => {}
        }
    }
    Ok(())
}

/// Every input exists and is available before its user; every activation has exactly one
/// producer; tangents feed only backward nodes; aliases never precede their storage.
fn check_dataflow(values: &[Value], nodes: &[Node]) -> Check {
    let mut produced = vec![false; values.len()];
    for n in nodes {
        check_node_inputs(values, n, &produced)?;
        for (k, &o) in n.outputs.iter().enumerate() {
            let v = values
                .get(o)
                .ok_or_else(|| format!("node {} ({}) outputs unknown value {o}", n.id, n.name))?;
            if v.kind != ValueKind::Activation {
                return Err(format!(
                    "node {} ({}) outputs {o} ({}) of kind {:?}",
                    n.id, n.name, v.name, v.kind
                ));
            }
            if produced[o] || n.outputs[..k].contains(&o) {
                return Err(format!(
                    "value {o} ({}) is produced twice (again by node {} ({}))",
                    v.name, n.id, n.name
                ));
            }
        }
        n.outputs.iter().for_each(|&o| produced[o] = true);
        check_alias_outputs(values, n, &produced)?;
    }
    match values
        .iter()
        .find(|v| v.kind == ValueKind::Activation && !produced[v.id])
    {
        Some(v) => Err(format!(
            "activation {} ({}) is produced by no node",
            v.id, v.name
        )),
        None => Ok(()),
    }
}

fn check_node_inputs(values: &[Value], n: &Node, produced: &[bool]) -> Check {
    for (k, &i) in n.inputs.iter().enumerate() {
        let v = values
            .get(i)
            .ok_or_else(|| format!("node {} ({}) uses unknown value {i}", n.id, n.name))?;
        if n.inputs[..k].contains(&i) {
            return Err(format!(
                "node {} ({}) lists input {i} ({}) twice",
                n.id, n.name, v.name
            ));
        }
        if v.kind == ValueKind::Tangent && n.phase != Phase::Backward {
            return Err(format!(
                "forward node {} ({}) uses tangent {i} ({})",
                n.id, n.name, v.name
            ));
        }
        if v.kind == ValueKind::Activation && !produced[i] {
            return Err(format!(
                "node {} ({}) uses {i} ({}) before any node produces it",
                n.id, n.name, v.name
            ));
        }
    }
    Ok(())
}

/// A node can only return views of its inputs or of its own outputs. Graph inputs are matched
/// loosely (viewing any graph input will do): tied parameters may come as two inputs sharing one
/// storage without saying so, and graph inputs are never counted anyway.
fn check_alias_outputs(values: &[Value], n: &Node, produced: &[bool]) -> Check {
    let owner_of = |v: usize| values[v].alias_of.unwrap_or(v);
    let shares_storage = |v: usize, owner: usize| {
        let o = owner_of(v);
        o == owner || (values[o].kind.is_graph_input() && values[owner].kind.is_graph_input())
    };
    for &o in &n.outputs {
        let Some(owner) = values[o].alias_of else {
            continue;
        };
        let mut candidates = n.inputs.iter().chain(&n.outputs);
        let viewed = candidates.any(|&v| v != o && shares_storage(v, owner));
        if !viewed || (values[owner].kind == ValueKind::Activation && !produced[owner]) {
            return Err(format!(
                "node {} ({}) outputs {o} ({}) as an alias of {owner} ({}), which is not the storage of \
                 one of its inputs or outputs",
                n.id, n.name, values[o].name, values[owner].name
            ));
        }
    }
    Ok(())
}

fn check_outputs(values: &[Value], nodes: &[Node], outputs: &[Output]) -> Check {
    let mut backward_made = vec![false; values.len()];
    for n in nodes.iter().filter(|n| n.phase == Phase::Backward) {
        n.outputs.iter().for_each(|&o| backward_made[o] = true);
    }
    for out in outputs {
        let i = out.value;
        let v = values
            .get(i)
            .ok_or_else(|| format!("graph output refers to unknown value {i}"))?;
        let forward_missing = backward_made[i] || v.kind == ValueKind::Tangent;
        let forward_kind = matches!(out.kind, OutputKind::Forward | OutputKind::Buffer);
        if forward_kind && forward_missing {
            return Err(format!(
                "{:?} output {i} ({}) does not exist in the forward phase",
                out.kind, v.name
            ));
        }
        if out.kind == OutputKind::Buffer {
            check_buffer_output(values, nodes, i)?;
        }
    }
    Ok(())
}

/// A buffer update is a new activation, and dead in the backward phase: no backward node reads
/// it or a view of its storage.
fn check_buffer_output(values: &[Value], nodes: &[Node], i: usize) -> Check {
    let v = &values[i];
    if v.kind != ValueKind::Activation {
        return Err(format!(
            "buffer output {i} ({}) is of kind {:?}, not an activation",
            v.name, v.kind
        ));
    }
    let owner = v.alias_of.unwrap_or(i);
    let same_storage = |x: usize| values[x].alias_of.unwrap_or(x) == owner;
    let reader = nodes
        .iter()
        .filter(|n| n.phase == Phase::Backward)
        .find(|n| n.inputs.iter().any(|&x| same_storage(x)));
    match reader {
        Some(n) => Err(format!(
            "backward node {} ({}) reads buffer output {i} ({}), which is released when the \
             backward phase starts",
            n.id, n.name, v.name
        )),
        None => Ok(()),
    }
}

/// A donor is an input activation owning a storage no other value views, not a graph output,
/// of the bytes of the node's one output, itself a new storage.
fn check_donors(values: &[Value], nodes: &[Node], outputs: &[Output]) -> Check {
    let mut viewed = vec![false; values.len()];
    values
        .iter()
        .filter_map(|v| v.alias_of)
        .for_each(|o| viewed[o] = true);
    for n in nodes {
        let Some(d) = n.donor else { continue };
        let why_not = if !n.inputs.contains(&d) {
            Some("it is not one of its inputs".to_string())
        } else if values[d].kind != ValueKind::Activation || values[d].alias_of.is_some() {
            Some("it is not an activation owning its storage".to_string())
        } else if viewed[d] {
            Some("other values view its storage".to_string())
        } else if outputs.iter().any(|o| o.value == d) {
            Some("it is a graph output".to_string())
        } else if n.outputs.len() != 1 || values[n.outputs[0]].alias_of.is_some() {
            Some("the node does not make one new storage".to_string())
        } else if values[n.outputs[0]].bytes != values[d].bytes {
            Some(format!(
                "its {} bytes differ from the output's {}",
                values[d].bytes, values[n.outputs[0]].bytes
            ))
        } else {
            None
        };
        if let Some(why) = why_not {
            return Err(format!(
                "node {} ({}) names {d} ({}) as its donor, but {why}",
                n.id, n.name, values[d].name
            ));
        }
    }
    Ok(())
}
