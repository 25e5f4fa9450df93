//! The chain in memory units as the recurrence counts it: each option's costs, the
//! segments' and sweeps' peaks, held bytes and times.

use super::*;

/// One option of a block, sizes in units.
pub(super) struct OptionCost {
    pub(super) saved: u64,
    pub(super) forward_temp: u64,
    pub(super) backward_temp: u64,
    /// [`crate::chain::BlockOption::forward_peak_bytes`].
    pub(super) forward_peak: Option<u64>,
    /// [`crate::chain::BlockOption::backward_peak_bytes`].
    pub(super) backward_peak: Option<u64>,
    pub(super) time: f64,
    /// [`crate::chain::BlockOption::refill`]: its time and its peak's index in the block's
    /// [`Costs::refill_peaks`] (never for `once` blocks).
    pub(super) refill: Option<(f64, usize)>,
    /// [`crate::chain::BlockOption::leaf`]: its time and own peak (never for `once` blocks).
    pub(super) leaf: Option<(f64, u64)>,
    /// [`crate::chain::BlockOption::split`]: the first part's own peak, the bytes between the
    /// parts and the second part's own peak.
    pub(super) split: Option<(u64, u64, u64)>,
    /// [`crate::chain::BlockOption::output_unread`].
    pub(super) output_unread: bool,
}

impl OptionCost {
    /// Memory `Fe` needs beyond what is alive before it, `xbar` its output and saved bytes.
    pub(super) fn forward_need(&self, xbar: u64) -> u64 {
        match self.forward_peak {
            Some(own) => xbar.max(own),
            None => xbar + self.forward_temp,
        }
    }

    /// Memory `B` needs beyond what is alive besides, with `xbar` and the gradients `δ` it
    /// reads (`delta_in`) and makes (`delta_out`).
    pub(super) fn backward_need(&self, xbar: u64, delta_in: u64, delta_out: u64) -> u64 {
        match self.backward_peak {
            Some(own) => (delta_in + xbar).max(own).max(delta_out),
            None => delta_in + xbar + delta_out + self.backward_temp,
        }
    }
}

/// The chain in memory units (bytes, or slots rounded up), as the recurrence counts it.
pub(super) struct Costs {
    pub(super) len: usize,
    /// `x_i` stored (`i` in `0..=L`): `x_0` and the returned `x_L` are the caller's (0).
    pub(super) x: Vec<u64>,
    /// `δ_i` (`i` in `0..=L+1`): `δ_L` is the caller's and `δ_{L+1}` does not exist (0).
    pub(super) delta: Vec<u64>,
    /// `x_L` recomputed after the loss: a copy beside the caller's.
    pub(super) output_copy: u64,
    /// `δ_L`, rounded down: room for the ops before the loss ([`Costs::forward_held`]).
    pub(super) loss_gradient: u64,
    /// [`Chain::loss_bytes`]: what the loss needs beside the chain's ([`Costs::loss_need`]).
    pub(super) loss_bytes: u64,
    pub(super) forward_temp: Vec<u64>,
    /// [`crate::chain::Block::forward_peak_bytes`].
    pub(super) nograd_own_peak: Vec<Option<u64>>,
    pub(super) forward_time: Vec<f64>,
    pub(super) options: Vec<Vec<OptionCost>>,
    /// The first [`crate::chain::Block::once`] block at or after `a` (`L` if none), `a` in
    /// `0..=L`.
    pub(super) next_once: Vec<usize>,
    /// Per block: the distinct own peaks of its options' refills, ascending.
    pub(super) refill_peaks: Vec<Vec<u64>>,
    /// Per block: its option in each segment profile ([`Costs::segments`],
    /// [`segment_profiles`]; none if no option refills).
    pub(super) segment: Vec<Vec<usize>>,
    /// Segments run in profiles: profile `p` runs each block with its option `segment[i][p]`.
    pub(super) profiles: usize,
    /// Per block: its options as the last block of a segment, whose output is kept
    /// ([`last_options`]).
    pub(super) last: Vec<Vec<usize>>,
    /// Per block: its options in `S` ([`Costs::last`] and [`Costs::segment`]); the position of
    /// each option's `S` row among the block's kinds of one profile, its `S'` row next if it
    /// splits (`usize::MAX` if not in `S`); and the number of those kinds.
    pub(super) sweep_options: Vec<Vec<usize>>,
    pub(super) sweep_position: Vec<Vec<usize>>,
    pub(super) sweep_kind_count: Vec<usize>,
    /// The distinct sub-chains of the tables.
    pub(super) pairs: Pairs,
}

impl Costs {
    pub(super) fn new(chain: &Chain, unit: u64) -> Costs {
        let len = chain.len();
        let up = |bytes: u64| bytes.div_ceil(unit);
        let mut x: Vec<u64> = chain.sizes.iter().map(|&s| up(s)).collect();
        let mut delta: Vec<u64> = (0..=len).map(|i| up(chain.delta(i))).collect();
        x[0] = 0;
        x[len] = 0;
        delta[len] = 0;
        delta.push(0);
        let refill_peaks: Vec<Vec<u64>> = chain
            .blocks
            .iter()
            .map(|b| {
                let mut peaks: Vec<u64> = b
                    .options
                    .iter()
                    .filter_map(|o| o.refill)
                    .map(|r| up(r.peak_bytes))
                    .collect();
                peaks.sort_unstable();
                peaks.dedup();
                peaks
            })
            .collect();
        let options: Vec<Vec<OptionCost>> = chain
            .blocks
            .iter()
            .zip(&refill_peaks)
            .map(|(b, peaks)| {
                b.options
                    .iter()
                    .map(|o| OptionCost {
                        saved: up(o.saved_bytes),
                        forward_temp: up(o.forward_temp_bytes),
                        backward_temp: up(o.backward_temp_bytes),
                        forward_peak: o.forward_peak_bytes.map(up),
                        backward_peak: o.backward_peak_bytes.map(up),
                        time: o.forward_time + o.backward_time,
                        refill: o.refill.filter(|_| !b.once).map(|r| {
                            let peak = peaks.binary_search(&up(r.peak_bytes));
                            (r.time, peak.expect("a refill peak"))
                        }),
                        leaf: o
                            .leaf
                            .filter(|_| !b.once)
                            .map(|l| (l.time, up(l.peak_bytes))),
                        output_unread: o.output_unread,
                        split: o.split.map(|s| {
                            let bytes = [s.first_peak_bytes, s.between_bytes, s.second_peak_bytes];
                            (up(bytes[0]), up(bytes[1]), up(bytes[2]))
                        }),
                    })
                    .collect()
            })
            .collect();
        let mut next_once = vec![len; len + 1];
        for a in (0..len).rev() {
            next_once[a] = if chain.blocks[a].once {
                a
            } else {
                next_once[a + 1]
            };
        }
        let segment = segment_profiles(chain, &options);
        let profiles = segment.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let last: Vec<Vec<usize>> = options.iter().map(|o| last_options(o)).collect();
        let sweep_options: Vec<Vec<usize>> = last
            .iter()
            .zip(&segment)
            .map(|(l, s)| {
                let mut all: Vec<usize> = l.iter().chain(s).copied().collect();
                all.sort_unstable();
                all.dedup();
                all
            })
            .collect();
        let mut sweep_kind_count = Vec::with_capacity(len);
        let sweep_position = sweep_options
            .iter()
            .zip(&options)
            .map(|(list, o)| {
                let mut position = vec![usize::MAX; o.len()];
                let mut count = 0;
                for &k in list {
                    position[k] = count;
                    count += 1 + usize::from(o[k].split.is_some());
                }
                sweep_kind_count.push(count);
                position
            })
            .collect();
        let mut costs = Costs {
            pairs: Pairs::default(), // made from the costs below
            sweep_kind_count,
            segment,
            profiles,
            last,
            sweep_options,
            sweep_position,
            len,
            x,
            delta,
            output_copy: up(chain.sizes[len]),
            loss_gradient: chain.delta(len) / unit,
            loss_bytes: up(chain.loss_bytes),
            forward_temp: chain
                .blocks
                .iter()
                .map(|b| up(b.forward_temp_bytes))
                .collect(),
            nograd_own_peak: chain
                .blocks
                .iter()
                .map(|b| b.forward_peak_bytes.map(up))
                .collect(),
            forward_time: chain.blocks.iter().map(|b| b.forward_time).collect(),
            options,
            next_once,
            refill_peaks,
        };
        costs.pairs = Pairs::new(&costs.positions());
        costs
    }

    /// Per position `i` in `0..=L+1`: its kind, equal where everything the tables read of `x_i`,
    /// `δ_i` and block `i` (the loss at `L`) is equal.
    pub(super) fn positions(&self) -> Vec<u32> {
        let mut kinds: HashMap<Vec<u64>, u32> = HashMap::new();
        (0..=self.len + 1)
            .map(|i| {
                let key = self.position_key(i);
                let next = kinds.len() as u32;
                *kinds.entry(key).or_insert(next)
            })
            .collect()
    }

    pub(super) fn position_key(&self, i: usize) -> Vec<u64> {
        let len = self.len;
        let some = |v: Option<u64>| [u64::from(v.is_some()), v.unwrap_or(0)];
        let mut key = vec![self.delta[i]];
        if i > len {
            return key;
        }
        key.push(self.x[i]);
        if i == len {
            key.extend([
                u64::MAX,
                self.output_copy,
                self.loss_gradient,
                self.loss_bytes,
            ]);
            return key;
        }
        key.extend([
            self.forward_temp[i],
            self.forward_time[i].to_bits(),
            u64::from(self.next_once[i] == i),
        ]);
        key.extend(some(self.nograd_own_peak[i]));
        key.extend(&self.refill_peaks[i]);
        key.push(u64::MAX);
        key.extend(self.segment[i].iter().map(|&k| k as u64));
        key.push(u64::MAX);
        for o in &self.options[i] {
            key.extend([o.saved, o.forward_temp, o.backward_temp, o.time.to_bits()]);
            key.extend(some(o.forward_peak));
            key.extend(some(o.backward_peak));
            let refill = o.refill.map(|(t, r)| [t.to_bits(), r as u64]);
            let leaf = o.leaf.map(|(t, peak)| [t.to_bits(), peak]);
            let split = o.split.map(|(f, b, s)| [f, b, s]);
            key.extend(refill.map_or([u64::MAX; 2], |r| r));
            key.extend(leaf.map_or([u64::MAX; 2], |l| l));
            key.extend(split.map_or([u64::MAX; 3], |s| s));
            key.push(u64::from(o.output_unread));
        }
        key
    }

    /// Memory a forward op inside `T(·, ·, b)` needs, `need` its own: with `δ_{b+1}` held, or
    /// before the loss (`b = L`) less `δ_L`, which counts for the whole step but arrives at the
    /// loss (rounded down, so that a sequence that fits in units fits in bytes).
    pub(super) fn forward_held(&self, b: usize, need: u64) -> u64 {
        if b == self.len {
            need.saturating_sub(self.loss_gradient)
        } else {
            self.delta[b + 1] + need
        }
    }

    /// Memory `T(·, L, L)` (the loss) needs: [`Chain::loss_bytes`], before `δ_L` arrives.
    pub(super) fn loss_need(&self) -> u64 {
        self.forward_held(self.len, self.loss_bytes)
    }

    /// The checkpoints `x_j` that `T(·, a, b)` may take: blocks `a` to `j-1` run without grad,
    /// so `j` stops at the first `once` block.
    pub(super) fn checkpoints(&self, a: usize, b: usize) -> std::ops::RangeInclusive<usize> {
        a + 1..=b.min(self.next_once[a])
    }

    /// `xbar_{a+1}` of option `k` inside `T(·, a, b)`: the output (a copy of `x_L` if the loss
    /// is behind, i.e. `b < L`) and the saved bytes.
    pub(super) fn xbar(&self, a: usize, k: usize, b: usize) -> u64 {
        let out = if a + 1 == self.len && b < self.len {
            self.output_copy
        } else {
            self.x[a + 1]
        };
        out + self.options[a][k].saved
    }

    /// `xbar_{a+1}` of option `k` as `B(a, k)` starts inside `T(·, a, b)`: without the output
    /// if `B(a, k)` does not read it and `B(a+1)` ran (`a < b`), which released it.
    pub(super) fn xbar_back(&self, a: usize, k: usize, b: usize) -> u64 {
        let o = &self.options[a][k];
        match a < b && o.output_unread {
            true => o.saved,
            false => self.xbar(a, k, b),
        }
    }

    /// Memory `Fe(a, k)` and `B(a, k)` need inside `T(·, a, b)`, beyond the caller's.
    pub(super) fn enable_peak(&self, a: usize, k: usize, b: usize) -> u64 {
        let o = &self.options[a][k];
        let forward = self.forward_held(b, o.forward_need(self.xbar(a, k, b)));
        let back = self.xbar_back(a, k, b);
        forward.max(o.backward_need(back, self.delta[a + 1], self.delta[a]))
    }

    /// The refill peak `r` if `T(·, a, b)` may run `D_k(·, a, b)` (`D` of peak `r`) after
    /// `Fe(a, k)`.
    pub(super) fn drops(&self, a: usize, k: usize, b: usize) -> Option<usize> {
        let (_, r) = self.options[a][k].refill?;
        (a + 1 < b).then_some(r)
    }

    /// The memory `B(a, k)` needs ending a segment's backward (`S(·, a, a)`), `x_{a+1}` held by
    /// the caller ([`Costs::output_back`]).
    pub(super) fn backward_peak(&self, a: usize, k: usize) -> u64 {
        let o = &self.options[a][k];
        o.backward_need(
            self.output_back(a, k) + o.saved,
            self.delta[a + 1],
            self.delta[a],
        )
    }

    /// `x_{a+1}` as `B(a, k)` of a segment starts (`x_{a+1}` kept, `B(a+1)` ran): none if
    /// `B(a, k)` does not read it.
    pub(super) fn output_back(&self, a: usize, k: usize) -> u64 {
        match self.options[a][k].output_unread {
            true => 0,
            false => self.x[a + 1],
        }
    }

    /// The memory `FB(a, k)` needs inside `T(·, a, a)`, if option `k` has a leaf.
    pub(super) fn leaf_peak(&self, a: usize, k: usize) -> Option<u64> {
        let (_, own) = self.options[a][k].leaf?;
        Some(own.max(self.delta[a + 1]).max(self.delta[a]))
    }

    /// Block `i`'s option in segment profile `p`.
    pub(super) fn segment_option(&self, i: usize, p: usize) -> usize {
        self.segment[i][p]
    }

    /// The segments `a..j` of `T(·, a, b)` (`Fe` of blocks `a` to `j-1`, each input but `x_a`
    /// dropped once read), by end `j` in `a+2..=b`, profile and option of block `j-1`: at most
    /// [`SEGMENT_BLOCKS`] blocks, each but the last with its option in the profile (the last
    /// one's output is kept: any option). A profile that runs the same options on the blocks
    /// before the last as an earlier one is left out.
    pub(super) fn segments(&self, a: usize, b: usize) -> Vec<Segment> {
        let mut out = Vec::new();
        for profile in 0..self.profiles {
            let (mut saved, mut time, mut peak) = (0, 0.0, 0);
            // Per earlier profile: whether it runs the same options on blocks `a..i`.
            let mut same = vec![true; profile];
            for i in a..b.min(a + SEGMENT_BLOCKS) {
                let distinct = same.iter().all(|&s| !s);
                let input = if i > a { self.x[i] } else { 0 };
                let step = |o: &OptionCost| {
                    let own = o.forward_need(self.x[i + 1] + o.saved);
                    peak.max(self.forward_held(b, saved + input + own))
                };
                if i > a && distinct {
                    for &k in &self.last[i] {
                        let o = &self.options[i][k];
                        out.push(Segment {
                            end: i + 1,
                            profile,
                            option: k,
                            forward_peak: step(o),
                            held: saved + o.saved + self.x[i + 1],
                            time: time + o.time,
                        });
                    }
                }
                if self.segment[i].is_empty() {
                    break;
                }
                for (q, s) in same.iter_mut().enumerate() {
                    *s &= self.segment[i][q] == self.segment[i][profile];
                }
                let o = &self.options[i][self.segment_option(i, profile)];
                peak = step(o);
                saved += o.saved;
                time += o.time;
            }
        }
        out
    }

    /// The sweeps of `S_{p,k}(·, a, c)` (`a < c`; its split form `S'`: `B1(c, k)` ran), by
    /// the input `x_i` they keep.
    pub(super) fn sweeps(&self, a: usize, c: usize, (p, k, split): Kind) -> Vec<Sweep> {
        let option = |i: usize| &self.options[i][self.segment_option(i, p)];
        let base = self.segment_saved(a, c, p) + self.backward_held(c, k, split);
        let mut out = Vec::new();
        let (mut extra, mut saved, mut time) = (0, 0, 0.0);
        for l in a..c {
            let (refill, r) = option(l).refill.expect("a segment option refills");
            let input = if l > a { self.x[l] } else { 0 };
            extra = extra.max(input + self.x[l + 1].max(self.refill_peaks[l][r]));
            saved += option(l).saved;
            time += refill;
            out.push(Sweep {
                keep: l + 1,
                peak: base + extra,
                held: saved + self.x[l + 1],
                time,
            });
        }
        out
    }

    /// Whether `S_{p,k}(·, a, c)` is used (for every profile `p` and option `k` of block `c`):
    /// a segment `a..c+1` may exist.
    pub(super) fn has_sweeps(&self, a: usize, c: usize) -> bool {
        c < self.len && c - a < SEGMENT_BLOCKS && (a..c).all(|i| !self.segment[i].is_empty())
    }

    /// The kind of every `S_{p,k}(·, a, c)` used: profile, option of block c, and whether its
    /// split form `S'` (where option `k` splits).
    pub(super) fn sweep_kinds(&self, a: usize, c: usize) -> impl Iterator<Item = Kind> + '_ {
        let options: &[usize] = match self.has_sweeps(a, c) {
            true => &self.sweep_options[c],
            false => &[],
        };
        let splits = move |k: usize| {
            let split = self.options[c][k].split.is_some();
            [false, true].into_iter().filter(move |&s| !s || split)
        };
        let kinds = move |p: usize| {
            options
                .iter()
                .flat_map(move |&k| splits(k).map(move |s| (p, k, s)))
        };
        (0..self.profiles).flat_map(kinds)
    }

    /// The bytes blocks `a..c` save with their options in profile `p`.
    pub(super) fn segment_saved(&self, a: usize, c: usize, p: usize) -> u64 {
        (a..c)
            .map(|i| self.options[i][self.segment_option(i, p)].saved)
            .sum()
    }

    /// What block `c`'s backward holds of its own as `S` starts: `δ_{c+1}` and `xbar_{c+1}`, or
    /// once `B1(c, k)` ran (`split`), the bytes between the parts.
    pub(super) fn backward_held(&self, c: usize, k: usize, split: bool) -> u64 {
        let o = &self.options[c][k];
        match (split, o.split) {
            (true, Some((_, between, _))) => between,
            _ => o.saved + self.output_back(c, k) + self.delta[c + 1],
        }
    }

    /// The memory `S'_{p,k}(·, c, c)` needs: the second part of `B(c, k)`, `x_c` held by the
    /// caller.
    pub(super) fn second_peak(&self, c: usize, k: usize) -> u64 {
        let (_, between, second) = self.options[c][k].split.expect("an option that splits");
        second.max(between).max(self.delta[c])
    }

    /// The memory `B1(c, k)` needs at the start of `S_{p,k}(·, a, c)`, if option `k` splits.
    pub(super) fn first_peak(&self, a: usize, c: usize, p: usize, k: usize) -> Option<u64> {
        let (first, _, _) = self.options[c][k].split?;
        Some(self.segment_saved(a, c, p) + first.max(self.backward_held(c, k, false)))
    }

    /// Whether `D(·, a, b)` is used: `a + 1 < b` and some option of block `a` refills.
    pub(super) fn has_drops(&self, a: usize, b: usize) -> bool {
        a + 1 < b && !self.refill_peaks[a].is_empty()
    }

    /// Memory `D(·, a, b)` needs with refill peak `r` of block `a` and option `k'` of block
    /// `a+1`, beyond `T(·, a+2, b)`'s (`xbar_{a+2}(k')` + that): `Fe(a+1, k')` and `B(a+1, k')`
    /// with `x_{a+1}`, and the refill while `xbar_{a+2}(k')` and `δ_{a+2}` are held; or, if
    /// option `k'` splits its backward and that needs less, `B1(a+1, k')` without `x_{a+1}`,
    /// then the refill while what is between the parts is held, then the second part (`true`).
    pub(super) fn drop_peak(&self, a: usize, r: usize, k2: usize, b: usize) -> (u64, bool) {
        let refill = self.refill_peaks[a][r];
        let x = self.x[a + 1];
        let xbar = self.xbar(a + 1, k2, b);
        let held = self.xbar_back(a + 1, k2, b) + self.delta[a + 2];
        let whole = (x + self.enable_peak(a + 1, k2, b)).max(held + x.max(refill));
        let o = &self.options[a + 1][k2];
        let Some((first, between, second)) = o.split else {
            return (whole, false);
        };
        let forward = x + self.forward_held(b, o.forward_need(xbar));
        let second = x + second.max(between).max(self.delta[a + 1]);
        let split = forward
            .max(first.max(held))
            .max(between + x.max(refill))
            .max(second);
        if split < whole {
            (split, true)
        } else {
            (whole, false)
        }
    }

    /// Memory block `i` needs running without grad, beyond what is alive before it.
    pub(super) fn nograd_own(&self, i: usize) -> u64 {
        match self.nograd_own_peak[i] {
            Some(own) => self.x[i + 1].max(own),
            None => self.x[i + 1] + self.forward_temp[i],
        }
    }

    /// Memory `Fck(a)` needs inside `T(·, a, b)`.
    pub(super) fn check_peak(&self, a: usize, b: usize) -> u64 {
        self.forward_held(b, self.nograd_own(a))
    }

    /// Memory `Fn(i)` needs inside `T(·, a, b)`.
    pub(super) fn nograd_peak(&self, i: usize, b: usize) -> u64 {
        self.forward_held(b, self.x[i] + self.nograd_own(i))
    }
}

/// `Fe(a) Fe(a+1) D(a) … Fe(j-1) D(j-2)` with the blocks' options in `profile` (`option` for
/// block `j-1`): the first op's peak, what stays held (their saved bytes and `x_j`), their `Fe`
/// and `B` times.
pub(super) struct Segment {
    pub(super) end: usize,
    pub(super) profile: usize,
    pub(super) option: usize,
    pub(super) forward_peak: u64,
    pub(super) held: u64,
    pub(super) time: f64,
}

/// A kind of `S` rows: profile, option of the last block, and whether the split form.
pub(super) type Kind = (usize, usize, bool);

/// `R(a) R(a+1) D(a) … R(i-1) D(i-2)` inside `S_{p,k}(·, a, c)`: its peak (with what `S` holds),
/// what stays held beside `S(·, i, c)` (saved bytes of blocks `a..i-1` and `x_i`), its time.
pub(super) struct Sweep {
    pub(super) keep: usize,
    pub(super) peak: u64,
    pub(super) held: u64,
    pub(super) time: f64,
}
