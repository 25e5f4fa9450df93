//! The one replay of a chain sequence: the memory model of `docs/checkpointable.md`, op by op.

use super::*;
use crate::schedule::Report;

impl Chain {
    /// Replays `ops`; an invalid op is an [`Error::Schedule`] naming the op and why.
    pub fn simulate(&self, ops: &[ChainOp]) -> Result<Report> {
        let mut replay = Replay::new(self);
        for (at, op) in ops.iter().enumerate() {
            replay
                .step(*op)
                .map_err(|why| Error::Schedule(format!("op {at} ({op}): {why}")))?;
        }
        replay.finish().map_err(Error::Schedule)?;
        let held = self.held_bytes();
        // `δ_L` arrives at the loss.
        let forward_peak_bytes = held - self.delta(self.len()) + replay.forward_peak;
        let backward_peak_bytes = held + replay.backward_peak;
        let peak_bytes = forward_peak_bytes.max(backward_peak_bytes);
        Ok(Report {
            peak_bytes,
            forward_peak_bytes,
            backward_peak_bytes,
            forward_end_bytes: held - self.delta(self.len()) + replay.forward_end,
            backward_start_bytes: held + replay.backward_start,
            time: replay.time,
            recomputed_time: replay.recomputed_time,
            beside_bytes: 0,
            step_peak_bytes: peak_bytes,
        })
    }
}
/// Where `x_i` lives: stored plain, or inside `xbar_i` (the output of `Fe(i-1)`, option `k`),
/// or dropped from it (the saved bytes of option `k` stay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    No,
    Plain,
    InXbar(usize),
    Dropped(usize),
}

impl Held {
    fn alive(self) -> bool {
        matches!(self, Held::Plain | Held::InXbar(_))
    }
}

struct Replay<'c> {
    chain: &'c Chain,
    x: Vec<Held>,
    /// Bytes counted for `x_i` as it was made (a copy of `x_L` made after the loss counts).
    x_bytes: Vec<u64>,
    /// The gradient held: `δ_i`.
    delta: Option<usize>,
    /// Whether block `i` ran with grad (`Fe`) already: a [`Block::once`] block runs once.
    enabled: Vec<bool>,
    /// The block whose backward ran its first part (`B1`) only.
    split: Option<usize>,
    backward: bool,
    live: u64,
    forward_peak: u64,
    backward_peak: u64,
    /// Bytes alive at the loss, before it runs (without `δ_L`).
    forward_end: u64,
    /// Bytes alive once the loss has run and handed `x_L` to the caller.
    backward_start: u64,
    time: f64,
    recomputed_time: f64,
}

impl<'c> Replay<'c> {
    fn new(chain: &'c Chain) -> Replay<'c> {
        let mut x = vec![Held::No; chain.len() + 1];
        x[0] = Held::Plain;
        Replay {
            chain,
            x,
            x_bytes: vec![0; chain.len() + 1],
            delta: None,
            enabled: vec![false; chain.len()],
            split: None,
            backward: false,
            live: 0,
            forward_peak: 0,
            backward_peak: 0,
            forward_end: 0,
            backward_start: 0,
            time: 0.0,
            recomputed_time: 0.0,
        }
    }

    /// Bytes counted for `x_i` made now: `x_0` and the returned `x_L` are the caller's.
    fn new_x_bytes(&self, i: usize) -> u64 {
        if i == 0 || (i == self.chain.len() && !self.backward) {
            0
        } else {
            self.chain.sizes[i]
        }
    }

    /// Bytes counted for `δ_i`: `δ_L` is the caller's.
    fn delta_bytes(&self, i: usize) -> u64 {
        if i == self.chain.len() {
            0
        } else {
            self.chain.delta(i)
        }
    }

    fn peak(&mut self, bytes: u64) {
        let peak = if self.backward {
            &mut self.backward_peak
        } else {
            &mut self.forward_peak
        };
        *peak = (*peak).max(bytes);
    }

    fn block(&self, i: usize) -> std::result::Result<&'c Block, String> {
        self.chain
            .blocks
            .get(i)
            .ok_or_else(|| format!("there is no block {i}"))
    }

    fn option(&self, i: usize, k: usize) -> std::result::Result<&'c BlockOption, String> {
        self.block(i)?
            .options
            .get(k)
            .ok_or_else(|| format!("block {i} has no option {k}"))
    }

    fn check_forward(&self, i: usize) -> std::result::Result<(), String> {
        self.block(i)?;
        if !self.x[i].alive() {
            return Err(format!("its input x_{i} is not alive"));
        }
        if self.x[i + 1] != Held::No {
            return Err(format!("its output x_{} is alive already", i + 1));
        }
        Ok(())
    }

    fn step(&mut self, op: ChainOp) -> std::result::Result<(), String> {
        match op {
            ChainOp::ForwardNoGrad { block: i } | ChainOp::ForwardCheck { block: i } => {
                self.check_forward(i)?;
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once, with grad (Fe)"));
                }
                let drop_input = matches!(op, ChainOp::ForwardNoGrad { .. });
                if drop_input && (i == 0 || self.x[i] != Held::Plain) {
                    return Err(format!("Fn drops x_{i}, which is not a stored activation"));
                }
                let out = self.new_x_bytes(i + 1);
                let block = self.block(i)?;
                let before = self.live;
                self.live += out;
                match block.forward_peak_bytes {
                    Some(own) => self.peak(self.live.max(before + own)),
                    None => self.peak(self.live + block.forward_temp_bytes),
                }
                self.x[i + 1] = Held::Plain;
                self.x_bytes[i + 1] = out;
                if drop_input {
                    self.release_x(i);
                }
                self.time += block.forward_time;
                self.recomputed_time += block.forward_time;
            }
            ChainOp::ForwardEnable {
                block: i,
                option: k,
            } => {
                self.check_forward(i)?;
                let option = self.option(i, k)?;
                // Its first run is before the loss, as `x_L` needs it and `Fn`/`Fck` cannot
                // make it: a run after the loss is a second one.
                if self.block(i)?.once && self.enabled[i] {
                    return Err(format!("block {i} runs only once, and it ran already"));
                }
                self.enabled[i] = true;
                let out = self.new_x_bytes(i + 1);
                let before = self.live;
                self.live += out + option.saved_bytes;
                match option.forward_peak_bytes {
                    Some(own) => self.peak(self.live.max(before + own)),
                    None => self.peak(self.live + option.forward_temp_bytes),
                }
                self.x[i + 1] = Held::InXbar(k);
                self.x_bytes[i + 1] = out;
                self.time += option.forward_time;
            }
            ChainOp::Loss => {
                if self.backward {
                    return Err("the loss was reached already".into());
                }
                let last = self.chain.len();
                if !self.x[last].alive() {
                    return Err(format!("the output x_{last} is not alive"));
                }
                self.forward_end = self.live;
                self.peak(self.live + self.chain.loss_bytes);
                self.backward = true;
                self.delta = Some(last);
                if self.x[last] == Held::Plain {
                    self.release_x(last); // handed to the caller, who holds it from now on
                }
                self.backward_start = self.live;
            }
            ChainOp::Backward {
                block: i,
                option: k,
            } => {
                let option = self.option(i, k)?;
                self.check_backward(i)?;
                if self.x[i + 1] != Held::InXbar(k) {
                    return Err(format!("xbar_{} of option {k} is not alive", i + 1));
                }
                let grad = self.delta_bytes(i);
                if self.split == Some(i) {
                    let split = option.split.expect("split by its option");
                    let base = self.live - split.between_bytes;
                    let own = split.second_peak_bytes.max(split.between_bytes);
                    self.peak(base + own.max(grad));
                    self.live = base + grad;
                    self.split = None;
                    self.release_x(i + 1);
                    self.backward_done(i);
                    self.time += (option.backward_time - split.time).max(0.0);
                    return Ok(());
                }
                match option.backward_peak_bytes {
                    Some(own) => {
                        let mine =
                            self.delta_bytes(i + 1) + option.saved_bytes + self.x_bytes[i + 1];
                        let base = self.live - mine;
                        self.peak(base + own.max(mine).max(grad));
                        self.live += grad;
                    }
                    None => {
                        self.live += grad;
                        self.peak(self.live + option.backward_temp_bytes);
                    }
                }
                self.live -= self.delta_bytes(i + 1) + option.saved_bytes;
                self.release_x(i + 1);
                self.backward_done(i);
                self.time += option.backward_time;
            }
            ChainOp::ForwardBackward {
                block: i,
                option: k,
            } => {
                let Some(leaf) = self.option(i, k)?.leaf else {
                    return Err(format!("option {k} of block {i} has no leaf"));
                };
                self.check_backward(i)?;
                if self.x[i + 1] != Held::No {
                    return Err(format!("x_{} is stored or dropped: FB makes none", i + 1));
                }
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once, and it ran already"));
                }
                let (incoming, grad) = (self.delta_bytes(i + 1), self.delta_bytes(i));
                let base = self.live - incoming;
                self.peak(base + leaf.peak_bytes.max(incoming).max(grad));
                self.live = base + grad;
                self.backward_done(i);
                self.time += leaf.time;
            }
            ChainOp::BackwardFirst {
                block: i,
                option: k,
            } => {
                let option = self.option(i, k)?;
                let Some(split) = option.split else {
                    return Err(format!("option {k} of block {i} has no split"));
                };
                self.check_gradient(i)?;
                if self.split.is_some() {
                    return Err(format!("the backward of block {i} is split already"));
                }
                if self.x[i + 1] != Held::InXbar(k) {
                    return Err(format!("xbar_{} of option {k} is not alive", i + 1));
                }
                let mine = self.delta_bytes(i + 1) + option.saved_bytes + self.x_bytes[i + 1];
                let base = self.live - mine;
                self.peak(base + split.first_peak_bytes.max(mine));
                self.live = base + split.between_bytes;
                self.x_bytes[i + 1] = 0;
                self.split = Some(i);
                self.time += split.time;
            }
            ChainOp::DropOutput { block: i } => {
                self.block(i)?;
                let Held::InXbar(k) = self.x[i + 1] else {
                    return Err(format!("x_{} is not stored by Fe({i})", i + 1));
                };
                if self.option(i, k)?.refill.is_none() {
                    return Err(format!("option {k} of block {i} cannot refill its output"));
                }
                if i + 1 == self.chain.len() {
                    return Err(format!("x_{} is the output", i + 1));
                }
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once"));
                }
                self.live -= self.x_bytes[i + 1];
                self.x_bytes[i + 1] = 0;
                self.x[i + 1] = Held::Dropped(k);
            }
            ChainOp::Refill { block: i } => {
                let Held::Dropped(k) = self.x[i + 1] else {
                    return Err(format!("x_{} is not dropped", i + 1));
                };
                if !self.x[i].alive() {
                    return Err(format!("its input x_{i} is not alive"));
                }
                let refill = self.option(i, k)?.refill.expect("dropped with a refill");
                let out = self.new_x_bytes(i + 1);
                self.peak(self.live + out.max(refill.peak_bytes));
                self.live += out;
                self.x[i + 1] = Held::InXbar(k);
                self.x_bytes[i + 1] = out;
                self.time += refill.time;
                self.recomputed_time += refill.time;
            }
        }
        Ok(())
    }

    /// `B(i)` or `FB(i)` may run: after the loss, holding `δ_{i+1}` and `x_i`.
    fn check_backward(&self, i: usize) -> std::result::Result<(), String> {
        self.check_gradient(i)?;
        if !self.x[i].alive() {
            return Err(format!("its input x_{i} is not alive"));
        }
        Ok(())
    }

    /// A backward of block `i` may run: after the loss, holding `δ_{i+1}`.
    fn check_gradient(&self, i: usize) -> std::result::Result<(), String> {
        if !self.backward {
            return Err("a backward before the loss".into());
        }
        if self.delta != Some(i + 1) {
            return Err(format!(
                "it needs the gradient δ_{}, but the gradient held is {:?}",
                i + 1,
                self.delta.map(|d| format!("δ_{d}"))
            ));
        }
        Ok(())
    }

    /// Block `i`'s backward ended: `δ_i` is held, a stored `x_i` is released, and so are the
    /// bytes of an `x_i` in `xbar_i` that block `i-1`'s backward does not read.
    fn backward_done(&mut self, i: usize) {
        self.delta = Some(i);
        match self.x[i] {
            Held::Plain => self.release_x(i),
            Held::InXbar(k) if self.chain.blocks[i - 1].options[k].output_unread => {
                self.live -= self.x_bytes[i];
                self.x_bytes[i] = 0;
            }
            _ => {}
        }
    }

    fn release_x(&mut self, i: usize) {
        self.live -= self.x_bytes[i];
        self.x_bytes[i] = 0;
        self.x[i] = if i == 0 { Held::Plain } else { Held::No };
    }

    fn finish(&self) -> std::result::Result<(), String> {
        if self.delta != Some(0) {
            return Err(format!(
                "the sequence ends holding {:?}, not the input's gradient δ_0",
                self.delta.map(|d| format!("δ_{d}"))
            ));
        }
        match (1..self.x.len()).find(|&i| self.x[i] != Held::No) {
            Some(i) if !self.x[i].alive() => Err(format!("x_{i} is dropped at the end")),
            Some(i) => Err(format!("x_{i} is still alive at the end")),
            None => Ok(()),
        }
    }
}
