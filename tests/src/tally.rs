//! Counting deliveries: sent, received, duplicates, lost.

use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// Counts what was sent and what came back, by message id.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    sent: BTreeSet<String>,
    received: HashMap<String, u32>,
    unexpected: u64,
}

impl Tally {
    /// An empty tally.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a sent id.
    pub fn sent(&mut self, id: impl Into<String>) {
        self.sent.insert(id.into());
    }

    /// Records a received id; ids never sent count as unexpected.
    pub fn received(&mut self, id: impl Into<String>) {
        let id = id.into();
        if self.sent.contains(&id) {
            *self.received.entry(id).or_default() += 1;
        } else {
            self.unexpected += 1;
        }
    }

    /// Number sent.
    pub fn sent_count(&self) -> usize {
        self.sent.len()
    }

    /// Distinct ids received.
    pub fn distinct_received(&self) -> usize {
        self.received.len()
    }

    /// Deliveries beyond the first of each id.
    pub fn duplicates(&self) -> u64 {
        self.received
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum()
    }

    /// Sent ids never received.
    pub fn lost(&self) -> Vec<&String> {
        self.sent
            .iter()
            .filter(|id| !self.received.contains_key(*id))
            .collect()
    }

    /// Received ids that were never sent here (crosstalk).
    pub fn unexpected(&self) -> u64 {
        self.unexpected
    }

    /// Whether every sent id arrived.
    pub fn complete(&self) -> bool {
        self.received.len() == self.sent.len()
    }

    /// Panics with the counts unless nothing was lost and nothing foreign arrived.
    pub fn assert_none_lost(&self, context: &str) {
        println!("{context}: {self}");
        let lost = self.lost();
        assert!(
            lost.is_empty(),
            "{context}: {} lost (first: {:?}); {self}",
            lost.len(),
            lost.first()
        );
        assert_eq!(
            self.unexpected, 0,
            "{context}: foreign messages arrived; {self}"
        );
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sent {} received {} duplicates {} lost {} unexpected {}",
            self.sent.len(),
            self.received.values().map(|n| u64::from(*n)).sum::<u64>(),
            self.duplicates(),
            self.lost().len(),
            self.unexpected
        )
    }
}
