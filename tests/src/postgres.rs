//! PostgreSQL for the suites of the OJS API's shared job store: the server
//! (`OJS_BRIDGE_TEST_POSTGRES_URL`, default the loopback one
//! `scripts/brokers.sh up` makes sure of) and a schema of each test's own,
//! dropped when the test ends.

use crate::brokers::{missing, probe_address, reachable};

/// The variable naming the server.
pub const VAR: &str = "OJS_BRIDGE_TEST_POSTGRES_URL";
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The server's URL when it listens; else a skip (or a failure under
/// `OJS_BRIDGE_REQUIRE_BROKERS=1`).
pub fn find() -> Option<String> {
    let url = std::env::var(VAR).unwrap_or_else(|_| DEFAULT_URL.to_owned());
    if reachable(&probe_address(&url)) {
        Some(url)
    } else {
        missing(
            VAR,
            &format!("nothing listens on {} (from {url})", probe_address(&url)),
        )
    }
}

/// A schema name of this test's own, dropped (with its tables) on drop.
#[derive(Debug)]
pub struct TestSchema {
    /// The server.
    pub url: String,
    /// The schema (what `[api] state_schema` names).
    pub name: String,
}

impl TestSchema {
    /// A fresh name on `url` (the replicas make the schema).
    pub fn new(url: &str) -> TestSchema {
        TestSchema {
            url: url.to_owned(),
            name: format!("t_{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// Runs `sql` on the server (from a thread of its own: the synchronous
    /// client must not run inside the test's runtime).
    pub fn execute(&self, sql: &str) -> Result<(), String> {
        let (url, sql) = (self.url.clone(), sql.to_owned());
        std::thread::spawn(move || {
            let mut client =
                postgres::Client::connect(&url, postgres::NoTls).map_err(|e| e.to_string())?;
            client.batch_execute(&sql).map_err(|e| e.to_string())
        })
        .join()
        .map_err(|_| "the PostgreSQL thread panicked".to_owned())?
    }

    /// One number a query answers (`SELECT count(*) …` on this schema).
    pub fn count(&self, sql: &str) -> Result<i64, String> {
        let (url, schema, sql) = (self.url.clone(), self.name.clone(), sql.to_owned());
        std::thread::spawn(move || {
            let mut client =
                postgres::Client::connect(&url, postgres::NoTls).map_err(|e| e.to_string())?;
            client
                .batch_execute(&format!("SET search_path TO \"{schema}\""))
                .map_err(|e| e.to_string())?;
            let row = client.query_one(&sql, &[]).map_err(|e| e.to_string())?;
            Ok(row.get::<_, i64>(0))
        })
        .join()
        .map_err(|_| "the PostgreSQL thread panicked".to_owned())?
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let _ = self.execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
    }
}
