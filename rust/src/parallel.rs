//! Independent work items on as many threads as the machine has cores.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    /// Whether this thread is one of `map`'s workers: a `map` inside one runs on it alone, so
    /// nested maps start no more threads than the machine has cores.
    static WORKER: Cell<bool> = const { Cell::new(false) };
}

/// `items.map(f)` in order, the items taken by threads one at a time (on the caller's thread
/// alone inside another `map`); a panic in `f` resumes on the caller's thread.
pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = if WORKER.with(Cell::get) {
        1
    } else {
        cores().min(items.len())
    };
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let mut found: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    WORKER.with(|w| w.set(true));
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return mine;
                        };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    found.sort_by_key(|&(i, _)| i);
    found.into_iter().map(|(_, r)| r).collect()
}

/// The cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    #[test]
    fn nested_maps_use_no_more_threads_than_cores() {
        let seen = Mutex::new(HashSet::new());
        let outer: Vec<usize> = (0..8).collect();
        let sums = map(&outer, |&i| {
            let inner: Vec<usize> = (0..8).collect();
            map(&inner, |&j| {
                seen.lock().unwrap().insert(std::thread::current().id());
                i * j
            })
            .into_iter()
            .sum::<usize>()
        });
        assert_eq!(sums, (0..8).map(|i| i * 28).collect::<Vec<_>>());
        assert!(seen.lock().unwrap().len() <= cores());
    }
}
