//! rotor's DP over chains: equal to an exhaustive search on small chains, sequences that the
//! simulator accepts under the limit, and a few cases whose answer is known.

use proptest::prelude::*;
use remat::testing::dp::{limits, min_limit, solve, Solver, DEFAULT_SLOTS};
use remat::Error;
use remat::{
    notation, Block, BlockOption, Chain, ChainOp, ChainSequence, Leaf, Refill, Report, Split,
};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

fn option(forward_time: f64, backward_time: f64, saved: u64, temps: (u64, u64)) -> BlockOption {
    BlockOption {
        forward_time,
        backward_time,
        saved_bytes: saved,
        forward_temp_bytes: temps.0,
        backward_temp_bytes: temps.1,
        forward_peak_bytes: None,
        backward_peak_bytes: None,
        refill: None,
        leaf: None,
        split: None,
        output_unread: false,
    }
}

fn block(forward_time: f64, forward_temp: u64, options: Vec<BlockOption>) -> Block {
    Block {
        name: String::new(),
        forward_time,
        forward_temp_bytes: forward_temp,
        forward_peak_bytes: None,
        options,
        once: false,
    }
}

/// `n` identical blocks: activations of `size` bytes, 1 s forward (with or without grad), 2 s
/// backward, nothing saved beyond the activations; input and output of 0 bytes.
fn uniform(n: usize, size: u64) -> Chain {
    let mut sizes = vec![size; n + 1];
    sizes[0] = 0;
    sizes[n] = 0;
    let blocks = (0..n)
        .map(|_| block(1.0, 0, vec![option(1.0, 2.0, 0, (0, 0))]))
        .collect();
    Chain::new(sizes, blocks, 0).unwrap()
}

fn solved(chain: &Chain, limit: u64) -> ChainSequence {
    let sequence = solve(chain, limit, DEFAULT_SLOTS).unwrap();
    let replay = chain.simulate(&sequence.ops).unwrap();
    assert_eq!(replay, sequence.predicted, "the prediction is the replay");
    assert!(replay.peak_bytes <= limit, "{replay:?} above {limit}");
    sequence
}

fn count(ops: &[ChainOp], pred: impl Fn(&ChainOp) -> bool) -> usize {
    ops.iter().filter(|op| pred(op)).count()
}

#[test]
fn plain_pytorch_when_it_fits() {
    let chain = uniform(4, 10);
    let (_, plain) = limits(&chain, DEFAULT_SLOTS).unwrap();
    let sequence = solved(&chain, plain);
    assert_eq!(
        notation(&sequence.ops),
        "Fe(0) Fe(1) Fe(2) Fe(3) Loss B(3) B(2) B(1) B(0)"
    );
    assert_eq!(sequence.predicted.time, 12.0);
    assert_eq!(sequence.predicted.recomputed_time, 0.0);
    // B(2): x_1, x_2, x_3 (in xbars), δ_3 and the new δ_2, 10 B each.
    assert_eq!(plain, 50);
}

#[test]
fn a_tighter_limit_recomputes_and_a_lower_one_more() {
    let chain = uniform(6, 10);
    let (min, plain) = limits(&chain, DEFAULT_SLOTS).unwrap();
    assert!(min < plain, "{min} {plain}");
    let mut last_time = 0.0;
    for limit in (min..=plain).rev().step_by(10) {
        let sequence = solved(&chain, limit);
        assert!(sequence.predicted.time >= last_time);
        last_time = sequence.predicted.time;
    }
    let lowest = solved(&chain, min);
    assert!(lowest.predicted.recomputed_time > 0.0);
    assert!(
        count(&lowest.ops, |op| matches!(
            op,
            ChainOp::ForwardNoGrad { .. }
        )) > 0
    );
}

#[test]
fn below_the_minimum_the_error_names_it() {
    let chain = uniform(5, 10);
    let min = min_limit(&chain, DEFAULT_SLOTS);
    match solve(&chain, min - 1, DEFAULT_SLOTS) {
        Err(Error::Infeasible { budget, min_budget }) => {
            assert_eq!((budget, min_budget), (min - 1, min));
        }
        other => panic!("expected an infeasible limit, got {other:?}"),
    }
    solved(&chain, min);
}

#[test]
fn one_block_and_the_loss() {
    let chain = Chain::new(
        vec![8, 4],
        vec![block(1.0, 0, vec![option(1.0, 1.0, 16, (2, 3))])],
        5,
    )
    .unwrap();
    let sequence = solved(&chain, 1 << 20);
    assert_eq!(notation(&sequence.ops), "Fe(0) Loss B(0)");
    // Held: output and its gradient (4 + 4) and 5 extra; B(0): 16 saved + δ_0 (8) + 3 temp. The
    // gradient arrives at the loss: the forward does not count it.
    assert_eq!(sequence.predicted.peak_bytes, 13 + 16 + 8 + 3);
    assert_eq!(sequence.predicted.forward_peak_bytes, 13 - 4 + 16 + 2);
}

#[test]
fn the_cheaper_option_is_chosen_where_memory_allows() {
    // Option 0 saves 100 B and is fast; option 1 saves 0 B and is slow. Block 1 is the same.
    let options = || vec![option(1.0, 1.0, 100, (0, 0)), option(5.0, 5.0, 0, (0, 0))];
    let chain = Chain::new(
        vec![0, 1, 0],
        vec![block(1.0, 0, options()), block(1.0, 0, options())],
        0,
    )
    .unwrap();
    let (min, plain) = limits(&chain, DEFAULT_SLOTS).unwrap();
    // B(1): x_1 (1 B) and δ_1 (1 B) beside both saved 100 B.
    assert_eq!(plain, 202);
    let roomy = solved(&chain, plain);
    assert_eq!(notation(&roomy.ops), "Fe(0) Fe(1) Loss B(1) B(0)");
    // One saved 100 B at a time: recomputing block 0 (1 s) beats a slow option (8 s more).
    let one_at_a_time = solved(&chain, 102);
    assert_eq!(
        notation(&one_at_a_time.ops),
        "Fck(0) Fe(1) Loss B(1) Fe(0) B(0)"
    );
    assert_eq!(one_at_a_time.predicted.time, 5.0);
    assert_eq!(min, 2);
    let tight = solved(&chain, min);
    assert_eq!(notation(&tight.ops), "Fe(0,1) Fe(1,1) Loss B(1,1) B(0,1)");
}

#[test]
fn json_round_trip_and_bad_chains() {
    let chain = uniform(3, 7);
    assert_eq!(Chain::from_json(&chain.to_json()).unwrap(), chain);
    let text = solve(&chain, 1000, 10).unwrap().to_json();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["schema"], "remat.chain_sequence");
    assert_eq!(value["ops"][0]["op"], "fe");
    assert!(value["notation"].as_str().unwrap().starts_with("Fe(0)"));
    let bad = r#"{"schema": "remat.chain", "version": 1, "sizes": [1], "blocks": [
        {"forward_time": 1.0, "options": []}]}"#;
    assert!(matches!(Chain::from_json(bad), Err(Error::Graph(m)) if m.contains("2 sizes")));
    let other = r#"{"schema": "remat.chain", "version": 2, "sizes": [], "blocks": []}"#;
    assert!(matches!(Chain::from_json(other), Err(Error::Graph(m)) if m.contains("version")));
}

#[test]
fn the_simulator_rejects_invalid_sequences() {
    let chain = uniform(2, 4);
    let bad = [
        vec![ChainOp::Loss],
        vec![ChainOp::ForwardNoGrad { block: 0 }],
        vec![
            ChainOp::ForwardCheck { block: 0 },
            ChainOp::ForwardCheck { block: 1 },
            ChainOp::Loss,
            ChainOp::Backward {
                block: 1,
                option: 0,
            },
        ],
        vec![
            ChainOp::ForwardEnable {
                block: 0,
                option: 0,
            },
            ChainOp::ForwardEnable {
                block: 1,
                option: 0,
            },
            ChainOp::Loss,
        ],
    ];
    assert_rejected(&chain, &bad);
}

/// A free refill of `x_1`: dropping it while blocks 2 and 3 run costs no time, where a chain
/// without refills recomputes.
#[test]
fn a_cheap_refill_replaces_a_recomputation() {
    let mut chain = uniform(4, 10);
    chain.blocks[0].options[0].refill = Some(Refill {
        time: 0.0,
        peak_bytes: 0,
    });
    let (_, plain) = limits(&chain, DEFAULT_SLOTS).unwrap();
    let limit = plain - 10;
    let sequence = solved(&chain, limit);
    assert_eq!(
        notation(&sequence.ops),
        "Fe(0) Fe(1) D(0) Fe(2) Fe(3) Loss B(3) B(2) R(0) B(1) B(0)"
    );
    assert_eq!(sequence.predicted.time, 12.0);
    let without = solved(&without_refills(&chain), limit);
    assert!(without.predicted.time > 12.0, "{}", notation(&without.ops));
    // What the simulator refuses: a drop of an output that cannot be refilled, a block that
    // reads a dropped input, a backward without the refill, a refill of what is not dropped.
    let (d, r) = (
        ChainOp::DropOutput { block: 0 },
        ChainOp::Refill { block: 0 },
    );
    let rejected = [
        vec![fe(0), fe(1), ChainOp::DropOutput { block: 1 }],
        vec![fe(0), d, fe(1)],
        vec![fe(0), fe(1), d, fe(2), ChainOp::Loss, bw(2), bw(1)],
        vec![fe(0), r],
        vec![fe(0), fe(1), d, fe(2), ChainOp::Loss, bw(2), r, r],
    ];
    assert_rejected(&chain, &rejected);
}

/// Free refills on every block: a segment runs every block once with grad, keeps only its first
/// input and recomputes the others by sweeps of refills, so that at the smallest limit the step
/// takes plain PyTorch's time, as the exhaustive search finds, where rotor's chain recomputes.
#[test]
fn a_segment_keeps_one_input_and_sweeps_refills() {
    let mut chain = uniform(6, 10);
    for b in &mut chain.blocks {
        b.options[0].refill = Some(Refill {
            time: 0.0,
            peak_bytes: 0,
        });
    }
    let plain_time = chain.simulate(&chain.plain_ops()).unwrap().time;
    let (min, _) = limits(&chain, DEFAULT_SLOTS).unwrap();
    let without = solved(&without_refills(&chain), min);
    assert!(without.predicted.time > plain_time);
    let sequence = solved(&chain, min);
    assert_eq!(sequence.predicted.time, plain_time);
    assert_eq!(brute_force(&chain, min).unwrap().0, plain_time);
    let refills = count(&sequence.ops, |op| matches!(op, ChainOp::Refill { .. }));
    assert!(refills >= 6, "{}", notation(&sequence.ops));
    assert!(notation(&sequence.ops).starts_with("Fe(0) Fe(1) D(0) Fe(2) D(1)"));
}

/// A leaf on every block (its backward reads only its input, and half its forward): `T(a, a)`
/// runs that half and the backward, where rotor's leaf runs the whole forward first.
#[test]
fn a_leaf_runs_only_the_forward_its_backward_reads() {
    let mut chain = uniform(4, 10);
    for b in &mut chain.blocks {
        b.forward_time = 2.0;
        b.options[0] = BlockOption {
            leaf: Some(Leaf {
                time: 5.0,
                peak_bytes: 0,
            }),
            ..option(2.0, 4.0, 0, (0, 0))
        };
    }
    let (min, _) = limits(&without_leaves(&chain), DEFAULT_SLOTS).unwrap();
    let sequence = solved(&chain, min);
    let without = solved(&without_leaves(&chain), min);
    assert!(sequence.predicted.time < without.predicted.time);
    assert_eq!(brute_force(&chain, min).unwrap().0, sequence.predicted.time);
    let fb = |block: usize| ChainOp::ForwardBackward { block, option: 0 };
    assert_eq!(
        notation(&sequence.ops),
        "Fe(0) Fe(1) Fck(2) Fe(3) Loss B(3) FB(2) B(1) B(0)"
    );
    // What the simulator refuses: `FB` before the loss, `FB` of a block whose output is stored,
    // `FB` of an option without a leaf.
    let stored = vec![
        fe(0),
        fe(1),
        fe(2),
        fe(3),
        ChainOp::Loss,
        bw(3),
        bw(2),
        fb(1),
    ];
    assert_rejected(&chain, &[vec![fb(0)], stored]);
    assert_rejected(&without_leaves(&chain), &[sequence.ops]);
}

/// Block 1's backward peaks before it reads its input `x_1`, which a free refill makes again
/// after that part: split around the refill, it needs less memory than any sequence holding
/// `x_1` through the whole backward.
#[test]
fn a_split_backward_refills_its_input_after_its_peak() {
    let mut chain = uniform(4, 10);
    chain.blocks[0].options[0].refill = Some(Refill {
        time: 0.0,
        peak_bytes: 0,
    });
    chain.blocks[1].options[0].backward_temp_bytes = 20;
    let whole = chain.clone();
    chain.blocks[1].options[0].split = Some(Split {
        time: 1.0,
        first_peak_bytes: 40,
        between_bytes: 10,
        second_peak_bytes: 10,
    });
    let (min, _) = limits(&chain, DEFAULT_SLOTS).unwrap();
    assert!(min < limits(&whole, DEFAULT_SLOTS).unwrap().0);
    let sequence = solved(&chain, min);
    let b1 = ChainOp::BackwardFirst {
        block: 1,
        option: 0,
    };
    assert!(notation(&sequence.ops).ends_with("B(2) B1(1) R(0) B(1) B(0)"));
    assert!(sequence.predicted.time >= brute_force(&chain, min).unwrap().0);
    // What the simulator refuses: `B1` of an option without a split, `B1` twice.
    let split_ops = sequence.ops.clone();
    assert_rejected(&whole, &[split_ops]);
    let at = sequence.ops.iter().position(|op| *op == b1).unwrap();
    let mut twice = sequence.ops[..=at].to_vec();
    twice.push(b1);
    assert_rejected(&chain, &[twice]);
}

/// The simulator refuses each sequence with a schedule error.
fn assert_rejected(chain: &Chain, sequences: &[Vec<ChainOp>]) {
    for ops in sequences {
        assert!(
            matches!(chain.simulate(ops), Err(Error::Schedule(_))),
            "{} was accepted",
            notation(ops)
        );
    }
}

/// `chain` with the blocks `once` run only once.
fn with_once(mut chain: Chain, once: &[usize]) -> Chain {
    for &i in once {
        chain.blocks[i].once = true;
    }
    chain
}

fn fe(block: usize) -> ChainOp {
    ChainOp::ForwardEnable { block, option: 0 }
}

fn bw(block: usize) -> ChainOp {
    ChainOp::Backward { block, option: 0 }
}

#[test]
fn the_simulator_runs_once_blocks_once_with_grad() {
    let chain = with_once(uniform(3, 4), &[1]);
    let (fck, fnn) = (
        |block| ChainOp::ForwardCheck { block },
        |block| ChainOp::ForwardNoGrad { block },
    );
    let rejected = [
        (vec![fck(0), fnn(1)], "op 1 (Fn(1))"),
        (vec![fe(0), fck(1)], "op 1 (Fck(1))"),
        (
            vec![fe(0), fe(1), fe(2), ChainOp::Loss, bw(2), bw(1), fe(1)],
            "op 6 (Fe(1))",
        ),
    ];
    for (ops, op) in rejected {
        match chain.simulate(&ops) {
            Err(Error::Schedule(m)) => {
                assert!(m.starts_with(op) && m.contains("only once"), "{m}")
            }
            other => panic!("{} gave {other:?}", notation(&ops)),
        }
    }
    // Recomputing the blocks around it is fine.
    let ops = [
        fck(0),
        fe(1),
        fe(2),
        ChainOp::Loss,
        bw(2),
        bw(1),
        fe(0),
        bw(0),
    ];
    chain.simulate(&ops).unwrap();
    chain.simulate(&chain.plain_ops()).unwrap();
}

/// The sequences of `chain` at every limit from the smallest feasible to plain PyTorch's.
fn all_limits(chain: &Chain) -> Vec<Vec<ChainOp>> {
    let (min, plain) = limits(chain, DEFAULT_SLOTS).unwrap();
    (min..=plain)
        .map(|limit| solved(chain, limit).ops)
        .collect()
}

#[test]
fn once_blocks_are_never_recomputed() {
    // Block 1 has two options; the output is large.
    let mut sizes = vec![10; 6];
    sizes[0] = 0;
    sizes[5] = 30;
    let mut blocks: Vec<Block> = (0..5)
        .map(|_| block(1.0, 0, vec![option(1.0, 2.0, 5, (0, 0))]))
        .collect();
    blocks[1].options.push(option(3.0, 3.0, 0, (0, 0)));
    let free = Chain::new(sizes, blocks, 0).unwrap();
    // The last block: recomputing it never saves memory (x_L is the caller's before the loss, a
    // copy after it), so the flag costs nothing.
    let last = with_once(free.clone(), &[4]);
    for (ops, free_ops) in all_limits(&last).iter().zip(all_limits(&free)) {
        assert!(
            ops.iter().filter_map(no_grad).all(|i| i != 4),
            "{}",
            notation(ops)
        );
        let time = |ops: &[ChainOp]| last.simulate(ops).unwrap().time;
        assert_eq!(time(ops), time(&free_ops));
    }
    // A block inside: no checkpoint after it before the loss, so the smallest limit rises.
    let inside = with_once(free.clone(), &[2]);
    let ops = all_limits(&inside);
    assert!(ops.iter().flatten().filter_map(no_grad).all(|i| i != 2));
    assert!(min_limit(&inside, DEFAULT_SLOTS) > min_limit(&free, DEFAULT_SLOTS));
    assert!(all_limits(&free)
        .iter()
        .flatten()
        .filter_map(no_grad)
        .any(|i| i == 2));
}

#[test]
fn gradients_of_their_own_size() {
    let chain = Chain::new(
        vec![8, 4],
        vec![block(1.0, 0, vec![option(1.0, 1.0, 16, (2, 3))])],
        5,
    )
    .unwrap()
    .with_deltas(vec![3, 6])
    .unwrap();
    assert_eq!((chain.delta(0), chain.delta(1)), (3, 6));
    assert_eq!(chain.held_bytes(), 4 + 6 + 5);
    let sequence = solved(&chain, 1 << 20);
    // B(0): 16 saved + δ_0 (3) + 3 temp beside what is held.
    assert_eq!(sequence.predicted.peak_bytes, 15 + 16 + 3 + 3);
    assert_eq!(sequence.predicted.forward_peak_bytes, 15 - 6 + 16 + 2);
    assert_eq!(Chain::from_json(&chain.to_json()).unwrap(), chain);
    let same = chain.with_deltas(Vec::new()).unwrap();
    assert_eq!(same.held_bytes(), 4 + 4 + 5);
}

#[test]
fn deltas_of_the_wrong_length_are_an_error() {
    let chain = uniform(3, 7);
    match chain.clone().with_deltas(vec![1, 2, 3]) {
        Err(Error::Graph(m)) => assert!(m.contains("3 blocks need 4 deltas"), "{m}"),
        other => panic!("expected an invalid chain, got {other:?}"),
    }
    let mut text: serde_json::Value = serde_json::from_str(&chain.to_json()).unwrap();
    text["deltas"] = serde_json::json!([1, 2]);
    let parsed = Chain::from_json(&text.to_string());
    assert!(matches!(parsed, Err(Error::Graph(m)) if m.contains("deltas")));
}

#[test]
fn chain_files_without_the_new_fields_parse_as_before() {
    let text = r#"{"schema": "remat.chain", "version": 1, "sizes": [0, 6, 2], "extra_bytes": 1,
        "blocks": [
            {"name": "a", "forward_time": 1.0, "options": [
                {"forward_time": 1.0, "backward_time": 2.0, "saved_bytes": 3}]},
            {"name": "b", "forward_time": 1.0, "options": [
                {"forward_time": 1.0, "backward_time": 2.0, "saved_bytes": 3}]}]}"#;
    let chain = Chain::from_json(text).unwrap();
    assert!(chain.deltas.is_empty());
    assert!(chain.blocks.iter().all(|b| !b.once));
    assert_eq!(
        (0..=2).map(|i| chain.delta(i)).collect::<Vec<_>>(),
        [0, 6, 2]
    );
    assert_eq!(chain.held_bytes(), 2 + 2 + 1);
    // Written back without them, as before.
    let written = chain.to_json();
    assert!(
        !written.contains("deltas") && !written.contains("once"),
        "{written}"
    );
    let flagged = with_once(chain.with_deltas(vec![1, 2, 3]).unwrap(), &[1]);
    assert_eq!(Chain::from_json(&flagged.to_json()).unwrap(), flagged);
}

// ---------------------------------------------------------------------------------------------
// Exhaustive search: every persistent sequence of Fn/Fck/Fe/Loss/B ops under the same memory
// rules, as a shortest path over states. rotor's DP is optimal among *persistent* sequences: an
// input kept by `Fck` or `Fe` (a checkpoint) stays until its own backward; only the intermediate
// values of a forward sweep are dropped by `Fn`. (Without that rule a sequence may consume a
// checkpoint early and recompute it later, which can be faster; rotor does not search those.)
// Sizes are small integers so that 500 slots are exact (one byte per slot).

/// `State::x` values: not alive, an intermediate, a checkpoint, inside `xbar` (+ option), or
/// dropped from `xbar` (+ option: its saved bytes stay).
const ABSENT: u8 = 0;
const PLAIN: u8 = 1;
const KEPT: u8 = 2;
const XBAR: u8 = 3;
const DROPPED: u8 = 100;

fn alive(x: u8) -> bool {
    x != ABSENT && x < DROPPED
}

fn in_xbar(x: u8) -> bool {
    (XBAR..DROPPED).contains(&x)
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    x: Vec<u8>,
    /// `x_L` made after the loss (a copy that counts).
    output_copy: bool,
    /// The gradient held (`u8::MAX`: none).
    delta: u8,
    /// The backward of the block that reads the gradient held ran its first part (`B1`) only.
    split: bool,
    /// Bit `i`: `x_i`, in `xbar_i`, was released (block `i-1`'s backward does not read it).
    gone: u32,
    backward: bool,
}

struct Search<'c> {
    chain: &'c Chain,
    capacity: u64,
}

impl Search<'_> {
    fn x_bytes(&self, s: &State, i: usize) -> u64 {
        let len = self.chain.len();
        match i {
            0 => 0,
            i if i == len && !s.output_copy => 0,
            i if s.gone & (1 << i) != 0 => 0,
            i => self.chain.sizes[i],
        }
    }

    fn delta_bytes(&self, i: usize) -> u64 {
        if i == self.chain.len() {
            0
        } else {
            self.chain.delta(i)
        }
    }

    fn saved(&self, i: usize, x: u8) -> u64 {
        let option = if x >= DROPPED { x - DROPPED } else { x - XBAR };
        self.chain.blocks[i - 1].options[option as usize].saved_bytes
    }

    fn live(&self, s: &State) -> u64 {
        let mut live = 0;
        for i in 1..s.x.len() {
            if alive(s.x[i]) {
                live += self.x_bytes(s, i);
            }
            if s.x[i] >= XBAR {
                live += self.saved(i, s.x[i]);
            }
        }
        if s.delta != u8::MAX {
            live += self.delta_bytes(s.delta as usize);
        }
        if s.split {
            let i = s.delta as usize - 1;
            let split = self.split_of(s, i);
            live = live - self.mine(s, i) + split.between_bytes;
        }
        live
    }

    /// `δ_{i+1}` and `xbar_{i+1}`, as `B(i)` counts them.
    fn mine(&self, s: &State, i: usize) -> u64 {
        self.delta_bytes(i + 1) + self.saved(i + 1, s.x[i + 1]) + self.x_bytes(s, i + 1)
    }

    /// The split of the option block `i` stored `xbar_{i+1}` with.
    fn split_of(&self, s: &State, i: usize) -> Split {
        let option = (s.x[i + 1] - XBAR) as usize;
        self.chain.blocks[i].options[option].split.unwrap()
    }

    /// The capacity, and before the loss `δ_L` too: it counts for the whole step but arrives at
    /// the loss.
    fn room(&self, s: &State) -> u64 {
        match s.backward {
            true => self.capacity,
            false => self.capacity + self.chain.delta(self.chain.len()),
        }
    }

    /// Every op that can run from `s` within the capacity: (next state, time, op).
    fn moves(&self, s: &State) -> Vec<(State, f64, ChainOp)> {
        let len = self.chain.len();
        let live = self.live(s);
        let room = self.room(s);
        let mut out = Vec::new();
        let made = |mut next: State, i: usize, value: u8| {
            next.x[i + 1] = value;
            if i + 1 == len {
                next.output_copy = s.backward;
            }
            if next.x[i] == PLAIN && value >= XBAR {
                next.x[i] = KEPT;
            }
            next
        };
        for i in 0..len {
            let b = &self.chain.blocks[i];
            self.drops_and_refills(s, i, live, &mut out);
            self.leaves(s, i, live, &mut out);
            if alive(s.x[i]) && s.x[i + 1] == ABSENT {
                let mut next = made(s.clone(), i, PLAIN);
                let out_bytes = self.x_bytes(&next, i + 1);
                let need = match b.forward_peak_bytes {
                    Some(own) => out_bytes.max(own),
                    None => out_bytes + b.forward_temp_bytes,
                };
                let fits = live + need <= room;
                if fits && !b.once {
                    let time = b.forward_time;
                    if i > 0 && s.x[i] == PLAIN {
                        let mut drop = next.clone();
                        drop.x[i] = ABSENT;
                        out.push((drop, time, ChainOp::ForwardNoGrad { block: i }));
                        next.x[i] = KEPT;
                    }
                    out.push((next, time, ChainOp::ForwardCheck { block: i }));
                }
                // A second `Fe` of a `once` block before the loss would need its `xbar` freed,
                // by its `B`: forbidding it after the loss is enough.
                let options = if b.once && s.backward {
                    &[][..]
                } else {
                    &b.options[..]
                };
                for (k, o) in options.iter().enumerate() {
                    let next = made(s.clone(), i, XBAR + k as u8);
                    let grow = self.x_bytes(&next, i + 1) + o.saved_bytes;
                    let need = match o.forward_peak_bytes {
                        Some(own) => grow.max(own),
                        None => grow + o.forward_temp_bytes,
                    };
                    if live + need <= room {
                        let op = ChainOp::ForwardEnable {
                            block: i,
                            option: k,
                        };
                        out.push((next, o.forward_time, op));
                    }
                }
            }
            let holds_gradient = s.backward && s.delta as usize == i + 1 && in_xbar(s.x[i + 1]);
            if holds_gradient && !s.split && b.options[(s.x[i + 1] - XBAR) as usize].split.is_some()
            {
                let option = (s.x[i + 1] - XBAR) as usize;
                let split = self.split_of(s, i);
                let mine = self.mine(s, i);
                if live - mine + split.first_peak_bytes.max(mine) <= self.capacity {
                    let mut next = s.clone();
                    next.split = true;
                    let op = ChainOp::BackwardFirst { block: i, option };
                    out.push((next, split.time, op));
                }
            }
            if holds_gradient && s.split && alive(s.x[i]) {
                let option = (s.x[i + 1] - XBAR) as usize;
                let split = self.split_of(s, i);
                let base = live - split.between_bytes;
                let own = split.second_peak_bytes.max(split.between_bytes);
                if base + own.max(self.delta_bytes(i)) <= self.capacity {
                    let next = self.backward_done(s, i);
                    let time = b.options[option].backward_time - split.time;
                    out.push((next, time, ChainOp::Backward { block: i, option }));
                }
            }
            if holds_gradient && !s.split && alive(s.x[i]) {
                let option = (s.x[i + 1] - XBAR) as usize;
                let o = &b.options[option];
                let peak = match o.backward_peak_bytes {
                    Some(own) => {
                        let mine = self.delta_bytes(i + 1) + o.saved_bytes + self.x_bytes(s, i + 1);
                        live - mine + own.max(mine).max(self.delta_bytes(i))
                    }
                    None => live + self.delta_bytes(i) + o.backward_temp_bytes,
                };
                if peak <= self.capacity {
                    let next = self.backward_done(s, i);
                    out.push((
                        next,
                        o.backward_time,
                        ChainOp::Backward { block: i, option },
                    ));
                }
            }
        }
        if !s.backward && s.x[len] != ABSENT && live + self.chain.loss_bytes <= room {
            let mut next = s.clone();
            next.backward = true;
            next.delta = len as u8;
            if next.x[len] < XBAR {
                next.x[len] = ABSENT; // a stored output is handed to the caller
            }
            out.push((next, 0.0, ChainOp::Loss));
        }
        out
    }

    /// `D(i)` of an output stored by an option that refills, any time; `R(i)` of a dropped one
    /// while `x_i` is alive.
    fn drops_and_refills(
        &self,
        s: &State,
        i: usize,
        live: u64,
        out: &mut Vec<(State, f64, ChainOp)>,
    ) {
        let b = &self.chain.blocks[i];
        let x = s.x[i + 1];
        if i + 1 == self.chain.len() || b.once || (s.split && s.delta as usize == i + 1) {
            return;
        }
        if in_xbar(x) && b.options[(x - XBAR) as usize].refill.is_some() {
            let mut next = s.clone();
            next.x[i + 1] = x - XBAR + DROPPED;
            next.gone &= !(1 << (i + 1));
            out.push((next, 0.0, ChainOp::DropOutput { block: i }));
        }
        if x >= DROPPED && alive(s.x[i]) {
            let refill = b.options[(x - DROPPED) as usize].refill.unwrap();
            let size = self.chain.sizes[i + 1];
            if live + size.max(refill.peak_bytes) <= self.room(s) {
                let mut next = s.clone();
                next.x[i + 1] = x - DROPPED + XBAR;
                out.push((next, refill.time, ChainOp::Refill { block: i }));
            }
        }
    }

    /// `FB(i, k)` of an option with a leaf, holding `δ_{i+1}` and `x_i` but not `x_{i+1}`.
    fn leaves(&self, s: &State, i: usize, live: u64, out: &mut Vec<(State, f64, ChainOp)>) {
        let b = &self.chain.blocks[i];
        let ready = s.backward && s.delta as usize == i + 1 && alive(s.x[i]);
        if !ready || s.x[i + 1] != ABSENT || b.once {
            return;
        }
        let (incoming, grad) = (self.delta_bytes(i + 1), self.delta_bytes(i));
        for (k, o) in b.options.iter().enumerate() {
            let Some(leaf) = o.leaf else { continue };
            if live - incoming + leaf.peak_bytes.max(incoming).max(grad) <= self.capacity {
                let next = self.backward_done(s, i);
                let op = ChainOp::ForwardBackward {
                    block: i,
                    option: k,
                };
                out.push((next, leaf.time, op));
            }
        }
    }

    /// The state after block `i`'s backward (`B`, its second part, or `FB`): `xbar_{i+1}` and a
    /// stored `x_i` released, `δ_i` held, and the bytes of an `x_i` in `xbar_i` that block
    /// `i-1`'s backward does not read released.
    fn backward_done(&self, s: &State, i: usize) -> State {
        let mut next = s.clone();
        next.x[i + 1] = ABSENT;
        next.gone &= !(1 << (i + 1));
        if i + 1 == self.chain.len() {
            next.output_copy = false;
        }
        if i > 0 && s.x[i] < XBAR {
            next.x[i] = ABSENT;
        }
        if in_xbar(s.x[i]) {
            let option = (s.x[i] - XBAR) as usize;
            if self.chain.blocks[i - 1].options[option].output_unread {
                next.gone |= 1 << i;
            }
        }
        next.delta = i as u8;
        next.split = false;
        next
    }

    /// A sequence of least time (times are integers, so sums are exact).
    fn best(&self) -> Option<(f64, Vec<ChainOp>)> {
        let len = self.chain.len();
        let mut x = vec![ABSENT; len + 1];
        x[0] = KEPT;
        let start = State {
            x,
            output_copy: false,
            delta: u8::MAX,
            split: false,
            gone: 0,
            backward: false,
        };
        let mut dist: HashMap<State, u64> = HashMap::from([(start.clone(), 0)]);
        let mut heap = BinaryHeap::from([Reverse((0u64, 0usize))]);
        // Per state pushed: the state, and the state and op it came from.
        let mut states = vec![(start, usize::MAX, ChainOp::Loss)];
        while let Some(Reverse((d, id))) = heap.pop() {
            let s = states[id].0.clone();
            if dist[&s] < d {
                continue;
            }
            if s.backward && s.delta == 0 && s.x[1..].iter().all(|&v| v == ABSENT) {
                let mut ops = Vec::new();
                let mut at = id;
                while states[at].1 != usize::MAX {
                    ops.push(states[at].2);
                    at = states[at].1;
                }
                ops.reverse();
                return Some((d as f64, ops));
            }
            for (next, time, op) in self.moves(&s) {
                let nd = d + time as u64;
                if dist.get(&next).is_none_or(|&old| nd < old) {
                    dist.insert(next.clone(), nd);
                    states.push((next, id, op));
                    heap.push(Reverse((nd, states.len() - 1)));
                }
            }
        }
        None
    }
}

fn brute_force(chain: &Chain, limit: u64) -> Option<(f64, Vec<ChainOp>)> {
    let capacity = limit.checked_sub(chain.held_bytes())?;
    Search { chain, capacity }.best()
}

/// An own peak (Rockmate's options) a third of the time, if `own_peaks`.
fn arb_own_peak(own_peaks: bool) -> BoxedStrategy<Option<u64>> {
    if own_peaks {
        prop_oneof![2 => Just(None), 1 => (0..16u64).prop_map(Some)].boxed()
    } else {
        Just(None).boxed()
    }
}

/// Options with a leaf a quarter of the time (a time of 1 to 8 and a peak of 0 to 11), and a
/// backward that does not read the output 30% of the time.
fn arb_option(own_peaks: bool) -> impl Strategy<Value = BlockOption> {
    let leaf = (1..9u32, 0..12u64).prop_map(|(t, p)| Leaf {
        time: f64::from(t),
        peak_bytes: p,
    });
    (
        (1..6u32, 1..6u32, 0..8u64, 0..3u64, 0..3u64),
        arb_own_peak(own_peaks),
        arb_own_peak(own_peaks),
        prop::option::weighted(0.25, leaf),
        prop::bool::weighted(0.3),
    )
        .prop_map(|((f, b, s, ft, bt), fp, bp, leaf, unread)| BlockOption {
            forward_peak_bytes: fp,
            backward_peak_bytes: bp,
            leaf,
            output_unread: unread,
            ..option(f as f64, b as f64, s, (ft, bt))
        })
}

/// Chains of up to 6 blocks; gradients of their own sizes half of the time if `deltas` (else
/// of their activations' sizes, rotor's model), a quarter of the blocks `once`, and the last one half of the time (a model output); bytes held at the loss
/// half of the time (the user's loss, buffer updates); own peaks on blocks and
/// options a third of the time if `own_peaks`. Half of the chains repeat their first one or two
/// blocks (sizes and gradients too), as layers do: the DP's tables share the rows of equal
/// sub-chains.
fn arb_chain(own_peaks: bool, deltas: bool) -> impl Strategy<Value = Chain> {
    (1..=6usize).prop_flat_map(move |n| {
        let options = if n <= 4 { 1..=2usize } else { 1..=1usize };
        let blocks = prop::collection::vec(
            (
                1..4u32,
                0..3u64,
                prop::collection::vec(arb_option(own_peaks), options),
                prop::bool::weighted(0.25),
                arb_own_peak(own_peaks),
            )
                .prop_map(|(t, tmp, opts, once, own)| Block {
                    once,
                    forward_peak_bytes: own,
                    ..block(t as f64, tmp, opts)
                }),
            n,
        );
        let deltas = match deltas {
            true => prop_oneof![Just(Vec::new()), prop::collection::vec(0..8u64, n + 1)].boxed(),
            false => Just(Vec::new()).boxed(),
        };
        (
            prop::collection::vec(0..8u64, n + 1),
            deltas,
            blocks,
            prop::bool::weighted(0.5),
            (0..3u64, prop_oneof![Just(0u64), 0..12u64]),
            (
                prop_oneof![Just(n), 1..=2usize],
                prop::array::uniform3(prop::bool::weighted(0.8)),
            ),
        )
            .prop_map(
                |(mut sizes, mut deltas, mut blocks, last_once, (extra, loss), repeats)| {
                    // Mostly equal blocks, some of them different in one respect only.
                    let (period, [same_sizes, same_deltas, same_once]) = repeats;
                    for i in period..blocks.len() {
                        let once = blocks[i].once;
                        blocks[i] = blocks[i % period].clone();
                        if !same_once {
                            blocks[i].once = once;
                        }
                        if same_sizes {
                            sizes[i] = sizes[i % period];
                        }
                        if let Some(&d) = deltas.get(i % period).filter(|_| same_deltas) {
                            deltas[i] = d;
                        }
                    }
                    blocks.last_mut().unwrap().once |= last_once;
                    let chain = Chain::new(sizes, blocks, extra).unwrap();
                    chain.with_deltas(deltas).unwrap().with_loss_bytes(loss)
                },
            )
    })
}

/// `chain` with a refill on half of its options (a time of 0 to 2 and a peak of 0 to 7).
fn with_refills(chain: Chain) -> impl Strategy<Value = Chain> {
    let count: usize = chain.blocks.iter().map(|b| b.options.len()).sum();
    let refill = (0..3u32, 0..8u64).prop_map(|(t, p)| Refill {
        time: f64::from(t),
        peak_bytes: p,
    });
    prop::collection::vec(prop::option::of(refill), count).prop_map(move |refills| {
        let mut chain = chain.clone();
        let options = chain.blocks.iter_mut().flat_map(|b| b.options.iter_mut());
        for (o, r) in options.zip(refills) {
            o.refill = r;
        }
        chain
    })
}

/// `chain` with a split on a quarter of its options (a first part of 0 to 5 s, at most the
/// backward's, and peaks and bytes between of 0 to 11).
fn with_splits(chain: Chain) -> impl Strategy<Value = Chain> {
    let count: usize = chain.blocks.iter().map(|b| b.options.len()).sum();
    let split = (0..6u32, 0..12u64, 0..12u64, 0..12u64).prop_map(|(t, f, m, s)| Split {
        time: f64::from(t),
        first_peak_bytes: f,
        between_bytes: m,
        second_peak_bytes: s,
    });
    let splits = prop::collection::vec(prop::option::weighted(0.25, split), count);
    splits.prop_map(move |splits| {
        let mut chain = chain.clone();
        let options = chain.blocks.iter_mut().flat_map(|b| b.options.iter_mut());
        for (o, split) in options.zip(splits) {
            o.split = split.map(|s| Split {
                time: s.time.min(o.backward_time),
                ..s
            });
        }
        chain
    })
}

/// `chain` without its refills.
fn without_refills(chain: &Chain) -> Chain {
    let mut chain = chain.clone();
    let options = chain.blocks.iter_mut().flat_map(|b| b.options.iter_mut());
    options.for_each(|o| o.refill = None);
    chain
}

/// `chain` without its leaves.
fn without_leaves(chain: &Chain) -> Chain {
    let mut chain = chain.clone();
    let options = chain.blocks.iter_mut().flat_map(|b| b.options.iter_mut());
    options.for_each(|o| o.leaf = None);
    chain
}

/// `chain` with sizes, gradients and saved bytes scaled up (and uneven), for coarse slots.
fn scaled(chain: Chain) -> Chain {
    let up = |s: &u64| s * 1000 + 7;
    let blocks = chain
        .blocks
        .iter()
        .map(|b| {
            let mut b = b.clone();
            for o in &mut b.options {
                o.saved_bytes *= 997;
                o.forward_peak_bytes = o.forward_peak_bytes.map(|p| p * 1000);
                o.backward_peak_bytes = o.backward_peak_bytes.map(|p| p * 1000);
            }
            b.forward_peak_bytes = b.forward_peak_bytes.map(|p| p * 1000);
            b
        })
        .collect();
    let sizes = chain.sizes.iter().map(up).collect();
    Chain::new(sizes, blocks, chain.extra_bytes)
        .unwrap()
        .with_deltas(chain.deltas.iter().map(up).collect())
        .unwrap()
        .with_loss_bytes(chain.loss_bytes * 1000)
}

/// Fn or Fck of a block.
fn no_grad(op: &ChainOp) -> Option<usize> {
    match *op {
        ChainOp::ForwardNoGrad { block } | ChainOp::ForwardCheck { block } => Some(block),
        _ => None,
    }
}

/// The limit `level` of the way from the smallest feasible limit to plain PyTorch's peak
/// (negative levels go below the smallest).
fn limit_at(chain: &Chain, level: f64) -> u64 {
    let (min, plain) = limits(chain, DEFAULT_SLOTS).unwrap();
    (min as f64 + (plain - min) as f64 * level).max(0.0) as u64
}

/// The DP's sequence replays within `limit` and runs no `once` block without grad; its replay.
fn check_valid(
    chain: &Chain,
    sequence: &ChainSequence,
    limit: u64,
) -> Result<Report, TestCaseError> {
    let replay = chain.simulate(&sequence.ops).unwrap();
    prop_assert!(replay.peak_bytes <= limit);
    let mut recomputed = sequence.ops.iter().filter_map(no_grad);
    prop_assert!(recomputed.all(|i| !chain.blocks[i].once));
    Ok(replay)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Without own peaks, and with gradients of their activations' sizes, the DP's time equals
    /// the exhaustive search's at any limit, and below the smallest feasible limit both fail,
    /// the DP naming that limit exactly.
    #[test]
    fn dp_equals_brute_force(chain in arb_chain(false, false), level in -0.2..1.0f64) {
        let limit = limit_at(&chain, level);
        let want = brute_force(&chain, limit);
        match solve(&chain, limit, DEFAULT_SLOTS) {
            Ok(sequence) => {
                let replay = check_valid(&chain, &sequence, limit)?;
                let (time, ops) = want.expect("the DP found a sequence");
                prop_assert_eq!(
                    replay.time, time, "limit {}: DP {} vs exhaustive {}",
                    limit, notation(&sequence.ops), notation(&ops)
                );
                // The search's rules are the simulator's.
                let searched = chain.simulate(&ops).unwrap();
                prop_assert!(searched.peak_bytes <= limit);
                prop_assert_eq!(searched.time, time);
            }
            Err(Error::Infeasible { min_budget, .. }) => {
                prop_assert!(want.is_none());
                prop_assert!(brute_force(&chain, min_budget).is_some());
                prop_assert!(brute_force(&chain, min_budget - 1).is_none());
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    /// With own peaks (Rockmate's options) or gradients smaller than their activations, rotor's
    /// recurrence is no longer optimal over every persistent op sequence: the exhaustive search
    /// may recompute an earlier segment before a later block's `B`, while a smaller gradient is
    /// held, which the recurrence never does. The DP's sequence is still valid and within the
    /// limit, never faster than the search's, and the smallest limit it names is feasible.
    #[test]
    fn dp_with_own_peaks_is_valid_and_never_beats_the_search(
        chain in arb_chain(true, true),
        level in -0.2..1.0f64,
    ) {
        let limit = limit_at(&chain, level);
        match solve(&chain, limit, DEFAULT_SLOTS) {
            Ok(sequence) => {
                let replay = check_valid(&chain, &sequence, limit)?;
                let (time, _) = brute_force(&chain, limit).expect("the DP found a sequence");
                prop_assert!(replay.time >= time, "DP {} beats the search's {}", replay.time, time);
            }
            Err(Error::Infeasible { min_budget, .. }) => {
                prop_assert!(brute_force(&chain, min_budget).is_some());
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    /// With refills, the DP's sequence is valid and within the limit, never slower than without
    /// them (it only adds choices), and never faster than the exhaustive search, which may drop
    /// any stored output at any time (the DP drops one of two consecutive inputs, for one
    /// block's run).
    #[test]
    fn dp_with_refills_is_between_the_search_and_no_refills(
        chain in arb_chain(false, true).prop_flat_map(with_refills).prop_flat_map(with_splits),
        level in -0.2..1.0f64,
    ) {
        let limit = limit_at(&chain, level);
        match solve(&chain, limit, DEFAULT_SLOTS) {
            Ok(sequence) => {
                let replay = check_valid(&chain, &sequence, limit)?;
                let (time, ops) = brute_force(&chain, limit).expect("the DP found a sequence");
                prop_assert!(
                    replay.time >= time,
                    "DP {} beats the search's {}", notation(&sequence.ops), notation(&ops)
                );
                prop_assert_eq!(chain.simulate(&ops).unwrap().time, time);
                if let Ok(plain) = solve(&without_refills(&chain), limit, DEFAULT_SLOTS) {
                    prop_assert!(
                        replay.time <= plain.predicted.time,
                        "DP {} slower than without refills: {}",
                        notation(&sequence.ops), notation(&plain.ops)
                    );
                }
            }
            Err(Error::Infeasible { min_budget, .. }) => {
                prop_assert!(brute_force(&chain, min_budget).is_some());
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    /// With coarse slots (sizes rounded up), the plan still fits the limit in bytes, and the
    /// named smallest limit is feasible.
    #[test]
    fn coarse_slots_stay_under_the_limit(
        chain in arb_chain(true, true).prop_map(scaled),
        slots in 2..40usize,
        level in 0.0..1.0f64,
    ) {
        let (min, plain) = limits(&chain, slots).unwrap();
        prop_assert!(solve(&chain, min, slots).is_ok());
        let limit = min + ((plain - min) as f64 * level) as u64;
        let sequence = solve(&chain, limit, slots).unwrap();
        prop_assert!(chain.simulate(&sequence.ops).unwrap().peak_bytes <= limit);
    }

    /// A [`Solver`] asked for many limits (tables shared by the limits of one unit, filled for
    /// the largest) answers each as a solve of that limit alone.
    #[test]
    fn a_solver_answers_each_limit_as_a_solve_alone(
        chain in arb_chain(true, true).prop_flat_map(with_refills).prop_flat_map(with_splits).prop_map(scaled),
        slots in 2..40usize,
        levels in prop::collection::vec(-0.1..1.1f64, 1..12),
    ) {
        let (min, plain) = limits(&chain, slots).unwrap();
        let solver = Solver::new(&chain, slots).unwrap();
        for level in levels {
            let limit = (min as f64 + (plain - min) as f64 * level) as u64;
            let alone = solve(&chain, limit, slots).map(|s| (s.ops, s.predicted));
            let shared = solver.solve(limit).map(|s| (s.ops, s.predicted));
            prop_assert_eq!(shared, alone, "at {}", limit);
        }
    }
}

#[test]
fn the_replay_reports_what_the_forward_hands_to_the_backward() {
    let chain = uniform(4, 100);
    let plain = chain.simulate(&chain.plain_ops()).unwrap();
    // x_1, x_2 and x_3 are stored for the backward; x_0 is the caller's and x_4 has no bytes.
    assert_eq!(plain.forward_end_bytes, 300);
    assert_eq!(plain.backward_start_bytes, 300);
    let (min, _) = limits(&chain, DEFAULT_SLOTS).unwrap();
    let tight = solved(&chain, min);
    let report = tight.predicted;
    assert!(report.forward_end_bytes < 300, "{report:?}");
    assert!(
        report.forward_end_bytes <= report.forward_peak_bytes,
        "{report:?}"
    );
    assert!(
        report.backward_start_bytes <= report.backward_peak_bytes,
        "{report:?}"
    );
}
