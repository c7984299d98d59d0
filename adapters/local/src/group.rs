//! Group commit without a writer task. A request that finds no commit
//! running starts one on the blocking pool and is its first member; requests
//! that arrive while it runs wait in the queue and go into its next commit.
//! A lone request so pays one hand-off (to the blocking pool), as a commit of
//! its own would, and concurrent ones share commits; a writer task between
//! them cost every request two more wake-ups.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

/// The requests waiting for a commit, and whether a commit run is going.
#[derive(Debug)]
pub(crate) struct GroupCommit<R> {
    state: Mutex<Waiting<R>>,
}

#[derive(Debug)]
struct Waiting<R> {
    requests: VecDeque<R>,
    running: bool,
}

impl<R> Default for GroupCommit<R> {
    fn default() -> Self {
        GroupCommit {
            state: Mutex::new(Waiting {
                requests: VecDeque::new(),
                running: false,
            }),
        }
    }
}

impl<R: Member> GroupCommit<R> {
    /// Queues `request`. When no commit run is going, starts one on the
    /// blocking pool: it hands `run` the waiting requests, a group at a
    /// time, until none waits.
    ///
    /// `owner` holds this queue (`field` finds it there) and what `run`
    /// needs (the adapter's connection).
    pub(crate) fn submit<H: Send + Sync + 'static>(
        owner: &Arc<H>,
        field: fn(&H) -> &GroupCommit<R>,
        request: R,
        run: fn(&Arc<H>, Vec<R>),
    ) {
        let start = {
            let mut state = lock(field(owner));
            state.requests.push_back(request);
            !std::mem::replace(&mut state.running, true)
        };
        if !start {
            return;
        }
        let mut leader = Leader {
            owner: owner.clone(),
            field,
            armed: true,
        };
        // A run that never starts (the runtime is shutting down) or that
        // panics drops `leader`, which ends the run and drops the requests
        // waiting: each caller hears it from its dropped reply.
        tokio::task::spawn_blocking(move || {
            while let Some(group) = leader.next_group() {
                run(&leader.owner, group);
            }
        });
    }
}

fn lock<R>(commit: &GroupCommit<R>) -> MutexGuard<'_, Waiting<R>> {
    // Only pushes and pops happen under the lock: a panic cannot leave the
    // queue half changed.
    commit.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request of a group commit, and the room it takes in one.
pub(crate) trait Member: Send + 'static {
    /// Most items, and most bytes, one commit takes (a request larger than
    /// either is committed alone).
    const LIMITS: (usize, usize);
    /// The items and bytes of this request.
    fn size(&self) -> (usize, usize);
}

/// The commit run: owns the running flag while it lives.
struct Leader<H, R: Member> {
    owner: Arc<H>,
    field: fn(&H) -> &GroupCommit<R>,
    armed: bool,
}

impl<H, R: Member> Leader<H, R> {
    /// The requests waiting, up to a full group; `None` (and the run ends)
    /// when none waits.
    fn next_group(&mut self) -> Option<Vec<R>> {
        let mut state = lock((self.field)(&self.owner));
        if state.requests.is_empty() {
            state.running = false;
            self.armed = false;
            return None;
        }
        let (mut items, mut bytes) = (0, 0);
        let mut group = Vec::new();
        while items < R::LIMITS.0 && bytes < R::LIMITS.1 {
            let Some(request) = state.requests.pop_front() else {
                break;
            };
            let (i, b) = request.size();
            items += i;
            bytes += b;
            group.push(request);
        }
        Some(group)
    }
}

impl<H, R: Member> Drop for Leader<H, R> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let dropped = {
            let mut state = lock((self.field)(&self.owner));
            state.running = false;
            std::mem::take(&mut state.requests)
        };
        drop(dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A request whose commit panics when `panics` is set.
    #[derive(Debug)]
    struct Request {
        value: u32,
        panics: bool,
        reply: tokio::sync::oneshot::Sender<u32>,
    }

    impl Member for Request {
        const LIMITS: (usize, usize) = (3, usize::MAX);
        fn size(&self) -> (usize, usize) {
            (1, 0)
        }
    }

    #[derive(Debug, Default)]
    struct Owner {
        queue: GroupCommit<Request>,
        groups: Mutex<Vec<usize>>,
    }

    fn run(owner: &Arc<Owner>, group: Vec<Request>) {
        owner
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(group.len());
        // Slow enough for the requests sent meanwhile to wait.
        std::thread::sleep(Duration::from_millis(20));
        for request in group {
            assert!(!request.panics, "the commit failed");
            let _ = request.reply.send(request.value * 2);
        }
    }

    fn submit(owner: &Arc<Owner>, value: u32, panics: bool) -> tokio::sync::oneshot::Receiver<u32> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let request = Request {
            value,
            panics,
            reply,
        };
        GroupCommit::submit(owner, |o| &o.queue, request, run);
        answer
    }

    /// Requests sent while a commit runs go into the next ones, at most
    /// `LIMITS` each; every request is answered once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_requests_share_commits_up_to_the_limit() {
        let owner = Arc::new(Owner::default());
        let answers: Vec<_> = (0..10).map(|v| submit(&owner, v, false)).collect();
        for (v, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer.await.unwrap(), v as u32 * 2);
        }
        let groups = owner.groups.lock().unwrap().clone();
        assert_eq!(groups.iter().sum::<usize>(), 10, "{groups:?}");
        assert!(groups.iter().all(|&g| g <= 3), "{groups:?}");
        assert!(
            groups.len() < 10,
            "no request waited for another: {groups:?}"
        );
        // The run ended when the queue was empty: a lone request starts one.
        assert_eq!(submit(&owner, 21, false).await.unwrap(), 42);
    }

    /// A commit that panics fails its group and what waited (their replies
    /// are dropped), and the next request starts a new run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_commit_fails_its_callers_and_the_next_request_runs() {
        let owner = Arc::new(Owner::default());
        let first = submit(&owner, 1, true);
        let waiting = submit(&owner, 2, false);
        assert!(first.await.is_err(), "the panicked commit answered");
        assert!(
            waiting.await.is_err(),
            "a request of the ended run answered"
        );
        // A request sent while the panicked run still unwinds (its callers
        // hear of it first) goes down with it, an error its caller retries;
        // once the run has ended, a request starts a new one. A run left
        // marked as going would leave every request waiting forever.
        let next = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match submit(&owner, 3, false).await {
                    Ok(answer) => return answer,
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        })
        .await
        .expect("no request after the panic started a run");
        assert_eq!(next, 6);
    }
}
