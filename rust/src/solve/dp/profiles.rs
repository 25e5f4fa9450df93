//! The options blocks run with in segments: profiles by rank and by a price of memory.

use super::*;

/// Most options of a block in segments, as their last block or in a profile.
pub(super) const PROFILES: usize = 4;

/// Each block's option in each segment profile ([`Costs::segment`]; none for blocks whose
/// options do not refill). Profiles by rank first: profile `p` runs each block's `p`-th segment
/// option ([`segment_options`]; its last if it has fewer). Then at most [`PRICED`] profiles by a
/// price of memory `λ`, spread over those that differ from all others: each block runs the
/// refilling option of least time (with the refill's) plus `λ` times its saved bytes (the least
/// saved among equals), `λ` from the points where some block's choice changes. Ranks pair the
/// options of blocks of one class; one price keeps the choices of blocks of different classes,
/// whose lists differ, alike (both save little, or both much).
pub(super) fn segment_profiles(chain: &Chain, options: &[Vec<OptionCost>]) -> Vec<Vec<usize>> {
    let fronts: Vec<Vec<usize>> = options.iter().map(|o| segment_options(o)).collect();
    let ranks = fronts.iter().map(Vec::len).max().unwrap_or(0);
    let by_rank = |p: usize| -> Vec<Option<usize>> {
        let pick = |f: &Vec<usize>| f.get(p.min(f.len().max(1) - 1)).copied();
        fronts.iter().map(pick).collect()
    };
    let mut profiles: Vec<Vec<Option<usize>>> = (0..ranks).map(by_rank).collect();
    // Per block: its refilling options as (option, time with the refill, saved bytes).
    let candidates: Vec<Vec<(usize, f64, u64)>> = options
        .iter()
        .zip(&chain.blocks)
        .map(|(costs, block)| {
            let each = costs.iter().enumerate().filter_map(|(k, o)| {
                let (refill, _) = o.refill?;
                Some((k, o.time + refill, block.options[k].saved_bytes))
            });
            each.collect()
        })
        .collect();
    let choose = |list: &[(usize, f64, u64)], price: f64| {
        let cost = |&(_, time, saved): &(usize, f64, u64)| (time + price * saved as f64, saved);
        let best = list
            .iter()
            .min_by(|p, q| cost(p).partial_cmp(&cost(q)).expect("finite times"));
        best.map(|&(k, _, _)| k)
    };
    let mut prices = vec![0.0];
    for list in &candidates {
        for &(_, t1, s1) in list {
            for &(_, t2, s2) in list {
                if s1 < s2 && t2 < t1 {
                    prices.push((t1 - t2) / (s2 - s1) as f64);
                }
            }
        }
    }
    prices.sort_by(|a, b| a.partial_cmp(b).expect("finite prices"));
    prices.dedup();
    let mut priced: Vec<Vec<Option<usize>>> = Vec::new();
    for &price in &prices {
        let profile: Vec<Option<usize>> = candidates.iter().map(|l| choose(l, price)).collect();
        if !profiles.contains(&profile) && !priced.contains(&profile) {
            priced.push(profile);
        }
    }
    if priced.len() > PRICED {
        let last = priced.len() - 1;
        let picks = (0..PRICED).map(|p| priced[(p * last).div_ceil(PRICED - 1)].clone());
        priced = picks.collect();
    }
    profiles.extend(priced);
    (0..options.len())
        .map(|i| profiles.iter().filter_map(|p| p[i]).collect())
        .collect()
}

/// Most segment profiles by a price of memory, beside those by rank.
pub(super) const PRICED: usize = 2;

/// The options of a block in segments: those that refill and that no other beats in both time
/// (with the refill's) and saved bytes, fastest first; at most [`PROFILES`], spread over them.
pub(super) fn segment_options(options: &[OptionCost]) -> Vec<usize> {
    let refills: Vec<usize> = (0..options.len())
        .filter(|&k| options[k].refill.is_some())
        .collect();
    let total = |k: usize| options[k].time + options[k].refill.map_or(0.0, |(t, _)| t);
    pareto(options, refills, total)
}

/// The options of a block as the last of a segment ([`Costs::last`]): those no other beats in
/// both time and saved bytes, fastest first; at most [`PROFILES`], spread over them.
pub(super) fn last_options(options: &[OptionCost]) -> Vec<usize> {
    pareto(options, (0..options.len()).collect(), |k| options[k].time)
}

/// Of `candidates`, those that no other beats in both `time` and saved bytes, fastest first
/// (the least saved among equals); at most [`PROFILES`], spread over them.
pub(super) fn pareto(
    options: &[OptionCost],
    mut candidates: Vec<usize>,
    time: impl Fn(usize) -> f64,
) -> Vec<usize> {
    candidates.sort_by(|&p, &q| {
        let key = |k: usize| (time(k), options[k].saved);
        key(p).partial_cmp(&key(q)).expect("finite times")
    });
    let mut front: Vec<usize> = Vec::new();
    for k in candidates {
        if front
            .last()
            .is_none_or(|&f| options[k].saved < options[f].saved)
        {
            front.push(k);
        }
    }
    if front.len() <= PROFILES {
        return front;
    }
    let last = front.len() - 1;
    (0..PROFILES)
        .map(|p| front[(p * last).div_ceil(PROFILES - 1)])
        .collect()
}
