//! Cuts a [`SimpleGraph`] into a chain of blocks (Rockmate's partition): the forward groups into
//! contiguous blocks at the places the fewest storages cross, each backward group into the block
//! whose backward runs it.
//!
//! Any contiguous cut gives a valid chain: a storage read outside the block producing it is
//! *exported* (held through its block's sub-problem) and counted by the chain: in the size of
//! the cut it spans, or as held for the whole step if it spans several. Cuts are chosen top-down: a segment larger than
//! `max_block_groups` forward groups is cut at every interior position where the fewest storages
//! cross, and the pieces are cut again (HiRemate's bottom-up grouping, seen from the top); a
//! graph that is a chain of layers is cut at its layer boundaries. Then neighbours are merged,
//! the smallest pair first, while the merged block is small (a block of one or two groups has a
//! single option and makes the chain coarse: on the saved encoder graph, merging them brought
//! Rockmate from 8.8% to 0.7% of the optimum at the smallest budgets), and while there are too
//! many blocks.

use crate::graph::simplify::{Hold, SimpleGraph, Tangent};

/// Partition settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionOptions {
    /// Largest block, in forward groups, that is not cut further.
    pub max_block_groups: usize,
    /// Neighbouring blocks are merged while the merged block has at most this many forward
    /// groups.
    pub join_groups: usize,
    /// Most blocks in the chain.
    pub max_blocks: usize,
}

impl Default for PartitionOptions {
    fn default() -> Self {
        PartitionOptions {
            max_block_groups: 24,
            join_groups: 8,
            max_blocks: 64,
        }
    }
}

/// A chain of blocks over the groups of a [`SimpleGraph`].
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// Per block: its forward groups, ascending.
    pub forward: Vec<Vec<usize>>,
    /// Per block: its backward groups, ascending.
    pub backward: Vec<Vec<usize>>,
    /// Per group: its block.
    pub block_of: Vec<usize>,
    /// `x_0 ..= x_L`: bytes of the forward storages spanning each cut (`x_0 = x_L = 0`).
    pub sizes: Vec<u64>,
    /// `δ_0 ..= δ_L`: bytes of the backward storages spanning each cut (`δ_0 = δ_L = 0`).
    pub deltas: Vec<u64>,
    /// Per storage: the first and last block among its producer's and its users'.
    pub span: Vec<(usize, usize)>,
    /// Bytes of the storages spanning two cuts or more (the chain holds them for the whole
    /// step rather than count them in several sizes at once).
    pub long_span_bytes: u64,
    /// `sizes` and `deltas` with each storage counted in every cut it spans, the long spans too
    /// (the chain [`super::Hierarchy::spread_chain`] plans with besides).
    pub spread: (Vec<u64>, Vec<u64>),
}

impl Partition {
    /// Whether the backward of the last block alone reads `tangent`: its own peaks then count it
    /// from the backward's start to its last read, instead of the chain holding it as `δ_L`.
    pub fn last_block_reads(&self, tangent: &Tangent) -> bool {
        let last = self.forward.len().wrapping_sub(1);
        !tangent.readers.is_empty() && tangent.readers.iter().all(|&g| self.block_of[g] == last)
    }

    /// Bytes of the tangents the chain holds as `δ_L`: those not read by the last block alone.
    pub fn held_tangent_bytes(&self, sg: &SimpleGraph) -> u64 {
        let held = sg.tangents.iter().filter(|t| !self.last_block_reads(t));
        held.map(|t| t.bytes).sum()
    }

    /// Bytes of the storages held for the step (graph outputs) that the last block's forward
    /// makes: the chain holds them for the whole step, though the forward before them does not.
    pub fn last_block_step_bytes(&self, sg: &SimpleGraph) -> u64 {
        let last = self.forward.len().wrapping_sub(1);
        let made = sg.storages.iter().filter(|st| {
            st.hold == Hold::Step
                && st.producer < sg.first_backward
                && self.block_of[st.producer] == last
        });
        made.map(|st| st.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.forward.len()
    }

    pub fn is_empty(&self) -> bool {
        self.forward.is_empty()
    }

    /// Whether `storage` is read by a group of another block than its producer's.
    pub fn exported(&self, storage: usize) -> bool {
        let (lo, hi) = self.span[storage];
        lo != hi
    }
}

/// The partition of `sg`.
pub fn partition(sg: &SimpleGraph, options: PartitionOptions) -> Partition {
    let forward_count = sg.first_backward;
    let mut cuts = Vec::new();
    if forward_count > 0 {
        let crossing = forward_crossings(sg);
        split(
            &crossing,
            0,
            forward_count,
            options.max_block_groups.max(1),
            &mut cuts,
        );
    }
    cuts.sort_unstable();
    let bounds = merge_small(
        forward_count,
        cuts,
        options.join_groups,
        options.max_blocks.max(1),
    );
    let blocks = bounds.len() - 1;
    let forward: Vec<Vec<usize>> = bounds.windows(2).map(|w| (w[0]..w[1]).collect()).collect();
    let mut block_of = vec![0; sg.groups.len()];
    for (b, groups) in forward.iter().enumerate() {
        groups.iter().for_each(|&g| block_of[g] = b);
    }
    let mut backward = vec![Vec::new(); blocks];
    for g in forward_count..sg.groups.len() {
        let b = backward_block(sg, &block_of, g, blocks);
        block_of[g] = b;
        backward[b].push(g);
    }
    let spans = spans(sg, &block_of, blocks);
    Partition {
        forward,
        backward,
        block_of,
        sizes: spans.sizes,
        deltas: spans.deltas,
        span: spans.span,
        long_span_bytes: spans.long_span_bytes,
        spread: spans.spread,
    }
}

/// Per cut position `p` in `0..=first_backward` (between forward groups `p-1` and `p`): how
/// many storages made before it are read by forward groups after it.
fn forward_crossings(sg: &SimpleGraph) -> Vec<usize> {
    let n = sg.first_backward;
    let mut diff = vec![0i64; n + 2];
    for st in &sg.storages {
        if st.producer >= n {
            continue;
        }
        let last = st.users.iter().copied().filter(|&u| u < n).max();
        if let Some(last) = last.filter(|&l| l > st.producer) {
            diff[st.producer + 1] += 1;
            diff[last + 1] -= 1;
        }
    }
    let mut count = Vec::with_capacity(n + 1);
    let mut running = 0i64;
    for d in diff.iter().take(n + 1) {
        running += d;
        count.push(running as usize);
    }
    count
}

/// Cuts `[lo, hi)` at every interior position of least crossing while it is too large.
fn split(crossing: &[usize], lo: usize, hi: usize, max_groups: usize, cuts: &mut Vec<usize>) {
    if hi - lo <= max_groups {
        return;
    }
    let least = (lo + 1..hi).map(|p| crossing[p]).min().unwrap_or(0);
    let mut start = lo;
    for p in (lo + 1..hi).filter(|&p| crossing[p] == least) {
        split(crossing, start, p, max_groups, cuts);
        cuts.push(p);
        start = p;
    }
    split(crossing, start, hi, max_groups, cuts);
}

/// Block bounds `0 = b_0 < ... < b_L = n` from sorted cuts: the smallest neighbours merged while
/// the merged block has at most `join_groups` groups; then, while there are more than
/// `max_blocks` blocks, every pair of neighbours of the smallest merged size at once, from the
/// left. Merging those pairs one at a time would leave a chain of repeated layers half merged
/// (GPT-2 48L: 32 layers as one block each, 16 as two), with three block classes to solve
/// instead of one.
fn merge_small(n: usize, cuts: Vec<usize>, join_groups: usize, max_blocks: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    bounds.extend(cuts.into_iter().filter(|&c| c > 0 && c < n));
    bounds.push(n);
    bounds.dedup();
    if n == 0 {
        return vec![0, 0];
    }
    let merged_size = |bounds: &[usize], i: usize| bounds[i + 1] - bounds[i - 1];
    while bounds.len() > 2 {
        let merged = (1..bounds.len() - 1)
            .min_by_key(|&i| merged_size(&bounds, i))
            .expect("more than one block");
        if merged_size(&bounds, merged) > join_groups {
            break;
        }
        bounds.remove(merged);
    }
    while bounds.len() - 1 > max_blocks {
        let least = (1..bounds.len() - 1)
            .map(|i| merged_size(&bounds, i))
            .min()
            .expect("more than one block");
        let mut kept = vec![bounds[0]];
        let mut i = 1;
        while i < bounds.len() - 1 {
            if merged_size(&bounds, i) == least {
                kept.push(bounds[i + 1]); // blocks i - 1 and i become one
                i += 2;
            } else {
                kept.push(bounds[i]);
                i += 1;
            }
        }
        if kept.last() != bounds.last() {
            kept.push(n);
        }
        bounds = kept;
    }
    bounds
}

/// The block whose backward runs backward group `g`: the earliest in backward order (largest
/// index) at which its inputs are available: no later than the blocks producing its backward
/// inputs, and within the forward reach of the storages it reads where possible.
fn backward_block(sg: &SimpleGraph, block_of: &[usize], g: usize, blocks: usize) -> usize {
    let n = sg.first_backward;
    let mut block = usize::MAX;
    for &s in &sg.groups[g].inputs {
        let st = &sg.storages[s];
        let reach = if st.producer >= n {
            block_of[st.producer]
        } else {
            let users = st.users.iter().copied().filter(|&u| u < n);
            users
                .map(|u| block_of[u])
                .fold(block_of[st.producer], usize::max)
        };
        block = block.min(reach);
    }
    if block == usize::MAX {
        blocks - 1
    } else {
        block
    }
}

struct Spans {
    sizes: Vec<u64>,
    deltas: Vec<u64>,
    span: Vec<(usize, usize)>,
    long_span_bytes: u64,
    spread: (Vec<u64>, Vec<u64>),
}

/// Each storage spans the blocks from the first to the last of its producer and users. One
/// spanning a single cut counts in that cut's size (`x` for forward storages, `δ` for backward
/// ones); one spanning more is alive across several checkpoints of the DP at once, and counts
/// as held for the whole step instead; in `spread`, it counts in the size of every cut it spans.
fn spans(sg: &SimpleGraph, block_of: &[usize], blocks: usize) -> Spans {
    let mut x = vec![0u64; blocks + 1];
    let mut delta = vec![0u64; blocks + 1];
    let (mut spread_x, mut spread_delta) = (x.clone(), delta.clone());
    let mut long_span_bytes = 0;
    let span: Vec<(usize, usize)> = sg
        .storages
        .iter()
        .map(|st| {
            let home = block_of[st.producer];
            let user_blocks = st.users.iter().map(|&u| block_of[u]);
            user_blocks.fold((home, home), |(lo, hi), b| (lo.min(b), hi.max(b)))
        })
        .collect();
    for (st, &(lo, hi)) in sg.storages.iter().zip(&span) {
        if lo == hi || st.hold != Hold::Planned {
            continue;
        }
        let spread = if st.producer < sg.first_backward {
            &mut spread_x
        } else {
            &mut spread_delta
        };
        spread[lo + 1..=hi].iter_mut().for_each(|b| *b += st.bytes);
        if hi - lo >= 2 {
            long_span_bytes += st.bytes;
        } else if st.producer < sg.first_backward {
            x[hi] += st.bytes;
        } else {
            delta[hi] += st.bytes;
        }
    }
    for sizes in [&mut x, &mut delta, &mut spread_x, &mut spread_delta] {
        sizes[blocks] = 0;
    }
    Spans {
        sizes: x,
        deltas: delta,
        span,
        long_span_bytes,
        spread: (spread_x, spread_delta),
    }
}

#[cfg(test)]
mod tests {
    use super::merge_small;

    /// Block sizes in groups.
    fn sizes(bounds: &[usize]) -> Vec<usize> {
        bounds.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[test]
    fn too_many_blocks_of_repeated_layers_merge_into_alike_blocks() {
        // A head of 2 groups, ten layers of two pieces (3 and 5 groups), a tail of 2.
        let mut cuts = vec![2];
        let mut at = 2;
        for _ in 0..10 {
            cuts.extend([at + 3, at + 8]);
            at += 8;
        }
        let n = at + 2;
        let bounds = merge_small(n, cuts, 1, 12);
        let blocks = sizes(&bounds);
        assert!(blocks.len() <= 12, "{blocks:?}");
        assert_eq!(blocks.iter().sum::<usize>(), n);
        let middle = &blocks[1..blocks.len() - 1];
        assert!(middle.iter().all(|&b| b == 8), "{blocks:?}");
    }

    #[test]
    fn blocks_within_the_limit_are_merged_only_while_small() {
        let bounds = merge_small(20, vec![1, 2, 10, 15], 3, 64);
        assert_eq!(sizes(&bounds), vec![2, 8, 5, 5]);
    }
}
