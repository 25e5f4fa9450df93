//! The class searches of this process, remembered by everything a search reads: the block's
//! graph with its groups' times, and the search's settings. A block searched again (the same
//! graph planned for another budget, the graph with the measured loss, whose blocks but the last
//! are unchanged, the same model planned again) takes the options found before, which a search
//! would find again: the per-block ILPs stop at a node limit, not a time, and the keep-set family
//! is a function of the block.

use super::block::{OptionSearch, Options};
use crate::graph::simplify::SimpleGraph;
use std::collections::{HashMap, VecDeque};
use std::sync::{LazyLock, Mutex};

/// Searches remembered; the oldest is forgotten first. A plan of a transformer searches about a
/// dozen classes (its blocks, the embedding and the head, on two partitions).
const REMEMBERED: usize = 64;

#[derive(Default)]
struct Memo {
    found: HashMap<String, Options>,
    order: VecDeque<String>,
}

static MEMO: LazyLock<Mutex<Memo>> = LazyLock::new(Mutex::default);

/// The options of `sub` under `search` found before in this process, if any.
pub fn remembered(sub: &SimpleGraph, search: &OptionSearch) -> Option<Options> {
    lock().found.get(&key(sub, search)).cloned()
}

/// Remembers `found`, the options of `sub` under `search`.
pub fn remember(sub: &SimpleGraph, search: &OptionSearch, found: &Options) {
    let key = key(sub, search);
    let mut memo = lock();
    if memo.found.insert(key.clone(), found.clone()).is_none() {
        memo.order.push_back(key);
        while memo.order.len() > REMEMBERED {
            let oldest = memo.order.pop_front().expect("more than REMEMBERED keys");
            memo.found.remove(&oldest);
        }
    }
}

/// `{:?}` writes every field, and each time as the shortest decimal that reads back exactly.
fn key(sub: &SimpleGraph, search: &OptionSearch) -> String {
    format!("{search:?}{sub:?}")
}

fn lock() -> std::sync::MutexGuard<'static, Memo> {
    // A search that panicked left no half-written entry: the memo stays usable.
    MEMO.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
