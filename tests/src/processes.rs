//! Broker processes a test owns, and freezing a broker with SIGSTOP.
//!
//! A test that freezes a broker or has to put the fault proxy on the broker's
//! advertised address (Kafka clients reconnect to the address the broker
//! advertises, bypassing a proxy on the bootstrap address) starts its own
//! broker process: tansu (`OJS_BRIDGE_TEST_TANSU`) or moto
//! (`OJS_BRIDGE_TEST_MOTO_SERVER`), both set by `scripts/brokers.sh env`.
//! The process is stopped by its PID when the test ends. RabbitMQ is the
//! machine's node: [`Frozen`] continues it on drop, and a watchdog process
//! continues it even if the test process dies first.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::brokers::{missing, rabbitmqctl_output, reachable};

/// A broker process started by a test; killed (by PID) on drop, and by its
/// watcher shell if the test process dies without dropping it (a killed or
/// timed-out test must not leave brokers behind).
#[derive(Debug)]
pub struct OwnBroker {
    watcher: Child,
    pid: u32,
    /// The address it listens on.
    pub listen: SocketAddr,
}

impl OwnBroker {
    /// Starts `program args` under a watcher shell that kills it once this
    /// test process is gone.
    fn spawn(program: &str, args: &[String], listen: SocketAddr, what: &str) -> Option<OwnBroker> {
        let quoted: Vec<String> = std::iter::once(program.to_owned())
            .chain(args.iter().cloned())
            .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
            .collect();
        let script = format!(
            "{} >/dev/null 2>&1 & c=$!; echo $c; \
             while kill -0 {parent} 2>/dev/null && kill -0 $c 2>/dev/null; do sleep 1; done; \
             kill -CONT $c 2>/dev/null; kill -9 $c 2>/dev/null",
            quoted.join(" "),
            parent = std::process::id()
        );
        let mut watcher = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut line = String::new();
        let stdout = watcher.stdout.take()?;
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).ok()?;
        let Ok(pid) = line.trim().parse() else {
            let _ = watcher.kill();
            return missing(what, "could not be started");
        };
        OwnBroker {
            watcher,
            pid,
            listen,
        }
        .wait_listening(what)
    }

    /// The broker's process id (for [`Frozen`]).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn wait_listening(mut self, what: &str) -> Option<OwnBroker> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if reachable(&self.listen.to_string()) {
                return Some(self);
            }
            if let Ok(Some(_)) = self.watcher.try_wait() {
                return missing(what, "exited at start");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        missing(what, "did not listen within 30 s")
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        // A frozen process cannot exit on SIGKILL until it is continued.
        signal(self.pid, "CONT");
        signal(self.pid, "KILL");
        let _ = self.watcher.kill();
        let _ = self.watcher.wait();
    }
}

fn program(var: &str, what: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(p) if std::path::Path::new(&p).exists() => Some(p),
        Ok(p) => missing(what, &format!("{var}={p} does not exist")),
        Err(_) => missing(what, &format!("{var} is not set (scripts/brokers.sh env)")),
    }
}

/// A tansu broker of the test's own on `listen`, advertising `advertised`
/// (put the fault proxy there so that every connection goes through it),
/// storage in memory.
pub fn own_tansu(listen: SocketAddr, advertised: SocketAddr) -> Option<OwnBroker> {
    let tansu = program("OJS_BRIDGE_TEST_TANSU", "tansu")?;
    let args = [
        "broker".to_owned(),
        "--listener-url".to_owned(),
        format!("tcp://{listen}"),
        "--advertised-listener-url".to_owned(),
        format!("tcp://{advertised}"),
        "--storage-engine".to_owned(),
        "memory://tansu/".to_owned(),
    ];
    OwnBroker::spawn(&tansu, &args, listen, "tansu (own)")
}

/// A moto server (SQS) of the test's own on `listen`.
pub fn own_moto(listen: SocketAddr) -> Option<OwnBroker> {
    let moto = program("OJS_BRIDGE_TEST_MOTO_SERVER", "moto")?;
    let args = [
        "-H".to_owned(),
        listen.ip().to_string(),
        "-p".to_owned(),
        listen.port().to_string(),
    ];
    OwnBroker::spawn(&moto, &args, listen, "moto (own)")
}

/// The OS process id of the RabbitMQ node the suites use (from
/// `rabbitmqctl status`).
pub fn rabbitmq_pid() -> Option<u32> {
    let status = rabbitmqctl_output(&["status"])?;
    status
        .lines()
        .find_map(|l| l.trim().strip_prefix("OS PID:"))
        .and_then(|pid| pid.trim().parse().ok())
}

fn signal(pid: u32, name: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A process stopped with SIGSTOP for as long as this lives (SIGCONT on
/// drop). A detached watchdog sends SIGCONT after `at_most` even if the
/// test process is killed before it can.
#[derive(Debug)]
pub struct Frozen {
    pid: u32,
    watchdog: Option<Child>,
}

impl Frozen {
    /// Freezes `pid`; `None` if it cannot be signalled.
    pub fn freeze(pid: u32, at_most: Duration) -> Option<Frozen> {
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!("sleep {}; kill -CONT {pid}", at_most.as_secs() + 1))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        signal(pid, "STOP").then_some(Frozen { pid, watchdog })
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.pid, "CONT");
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}
