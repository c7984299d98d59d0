//! Which offsets may be committed: only the contiguous prefix of settled
//! offsets per partition. An unsettled offset N holds the commit point at N
//! however many later offsets were acked (Vector lost data by committing past
//! an unfinished offset; we do not).

use std::collections::BTreeMap;
use std::sync::Arc;

/// (topic, partition). Topics are interned: one allocation per topic, not
/// per record.
pub(crate) type Tp = (Arc<str>, i32);

#[derive(Debug, Default)]
struct Partition {
    /// Bumped when the partition is revoked: settles from an older
    /// generation no longer count.
    generation: u64,
    /// Delivered offsets and whether they are settled.
    in_flight: BTreeMap<i64, bool>,
    /// Next offset to commit (one past the settled prefix).
    next: Option<i64>,
    /// Last offset committed.
    committed: Option<i64>,
}

/// Offsets delivered and settled, per partition.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    /// A consumer holds a handful of partitions: a linear scan comparing
    /// interned topic pointers beats hashing the topic name per record.
    parts: Vec<(Tp, Partition)>,
}

fn same(a: &Tp, b: &Tp) -> bool {
    a.1 == b.1 && (Arc::ptr_eq(&a.0, &b.0) || a.0 == b.0)
}

/// A settle that no longer applies: the partition was revoked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Stale;

impl Tracker {
    fn part(&mut self, tp: &Tp) -> Option<&mut Partition> {
        self.parts
            .iter_mut()
            .find(|(t, _)| same(t, tp))
            .map(|(_, p)| p)
    }

    fn part_or_insert(&mut self, tp: &Tp) -> &mut Partition {
        let i = match self.parts.iter().position(|(t, _)| same(t, tp)) {
            Some(i) => i,
            None => {
                self.parts.push((tp.clone(), Partition::default()));
                self.parts.len() - 1
            }
        };
        &mut self.parts[i].1
    }

    /// Records a delivered offset; returns the partition's generation.
    pub(crate) fn deliver(&mut self, tp: &Tp, offset: i64) -> u64 {
        let p = self.part_or_insert(tp);
        p.in_flight.insert(offset, false);
        p.generation
    }

    /// Marks an offset settled and advances the contiguous prefix.
    pub(crate) fn settle(&mut self, tp: &Tp, offset: i64, generation: u64) -> Result<(), Stale> {
        let p = self.part(tp).ok_or(Stale)?;
        if p.generation != generation {
            return Err(Stale);
        }
        match p.in_flight.get_mut(&offset) {
            Some(done) => *done = true,
            None => return Err(Stale),
        }
        while let Some(entry) = p.in_flight.first_entry() {
            if !*entry.get() {
                break;
            }
            let (off, _) = entry.remove_entry();
            p.next = Some(off + 1);
        }
        Ok(())
    }

    /// Offsets that advanced since the last call: (topic, partition, next).
    pub(crate) fn committable(&mut self) -> Vec<(String, i32, i64)> {
        let mut out = Vec::new();
        for ((topic, partition), p) in &mut self.parts {
            if let Some(next) = p.next {
                if p.committed.is_none_or(|c| next > c) {
                    out.push((topic.to_string(), *partition, next));
                    p.committed = Some(next);
                }
            }
        }
        out
    }

    /// Committable offsets of some partitions only (for a revocation).
    pub(crate) fn committable_for(&mut self, tps: &[Tp]) -> Vec<(String, i32, i64)> {
        let mut out = Vec::new();
        for tp in tps {
            if let Some(p) = self.part(tp) {
                if let Some(next) = p.next {
                    if p.committed.is_none_or(|c| next > c) {
                        out.push((tp.0.to_string(), tp.1, next));
                        p.committed = Some(next);
                    }
                }
            }
        }
        out
    }

    /// Forgets revoked partitions: their unsettled messages go to the next
    /// owner, and late settles report [`Stale`].
    pub(crate) fn revoke(&mut self, tps: &[Tp]) {
        for tp in tps {
            if let Some(p) = self.part(tp) {
                p.generation += 1;
                p.in_flight.clear();
                p.next = None;
                p.committed = None;
            }
        }
    }

    /// Per partition, how many offsets are tracked (delivered and not yet
    /// behind the commit point): what one unsettled offset makes grow.
    pub(crate) fn tracked(&self) -> impl Iterator<Item = (&Tp, usize)> + '_ {
        self.parts.iter().map(|(tp, p)| (tp, p.in_flight.len()))
    }

    /// Partitions with unsettled offsets (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn unsettled(&self, tp: &Tp) -> usize {
        self.parts
            .iter()
            .find(|(t, _)| same(t, tp))
            .map_or(0, |(_, p)| p.in_flight.values().filter(|d| !**d).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp() -> Tp {
        (Arc::from("t"), 0)
    }

    #[test]
    fn an_unsettled_offset_holds_the_commit_point_whatever_the_ack_order() {
        let mut t = Tracker::default();
        let g = (0..=100).map(|o| t.deliver(&tp(), o)).last().unwrap();
        // Ack everything except offset 42, in reverse order.
        for o in (0..=100).rev().filter(|o| *o != 42) {
            t.settle(&tp(), o, g).unwrap();
        }
        assert_eq!(
            t.committable(),
            vec![("t".into(), 0, 42)],
            "commit stops at the hole"
        );
        assert_eq!(t.committable(), vec![], "nothing new");
        t.settle(&tp(), 42, g).unwrap();
        assert_eq!(
            t.committable(),
            vec![("t".into(), 0, 101)],
            "hole filled: everything"
        );
        assert_eq!(t.unsettled(&tp()), 0);
    }

    #[test]
    fn gaps_and_redeliveries_keep_the_prefix_rule() {
        let mut t = Tracker::default();
        // Offsets with gaps (compaction, transaction markers).
        let g = [5, 7, 10].map(|o| t.deliver(&tp(), o))[2];
        t.settle(&tp(), 10, g).unwrap();
        t.settle(&tp(), 7, g).unwrap();
        assert_eq!(t.committable(), vec![], "5 is not settled");
        // 7 delivered again (a seek): unsettled again, order kept.
        t.deliver(&tp(), 7);
        t.deliver(&tp(), 6);
        t.settle(&tp(), 5, g).unwrap();
        assert_eq!(t.committable(), vec![("t".into(), 0, 6)]);
        t.settle(&tp(), 6, g).unwrap();
        t.settle(&tp(), 7, g).unwrap();
        assert_eq!(t.committable(), vec![("t".into(), 0, 11)]);
        assert_eq!(t.unsettled(&tp()), 0);
        assert_eq!(t.settle(&tp(), 8, g), Err(Stale), "never delivered");
    }

    #[test]
    fn revocation_makes_late_settles_stale() {
        let mut t = Tracker::default();
        let g = t.deliver(&tp(), 5);
        t.deliver(&tp(), 6);
        t.settle(&tp(), 5, g).unwrap();
        assert_eq!(t.committable_for(&[tp()]), vec![("t".into(), 0, 6)]);
        t.revoke(&[tp()]);
        assert_eq!(t.settle(&tp(), 6, g), Err(Stale));
        let g2 = t.deliver(&tp(), 6);
        assert_ne!(g, g2);
        t.settle(&tp(), 6, g2).unwrap();
        assert_eq!(t.committable(), vec![("t".into(), 0, 7)]);
    }

    #[test]
    fn tracked_counts_what_a_hole_holds_back() {
        let mut t = Tracker::default();
        let g = (0..10).map(|o| t.deliver(&tp(), o)).last().unwrap();
        for o in 1..10 {
            t.settle(&tp(), o, g).unwrap();
        }
        let counts: Vec<usize> = t.tracked().map(|(_, n)| n).collect();
        assert_eq!(counts, vec![10], "offset 0 holds back nine settled ones");
        t.settle(&tp(), 0, g).unwrap();
        let counts: Vec<usize> = t.tracked().map(|(_, n)| n).collect();
        assert_eq!(counts, vec![0]);
    }

    #[test]
    fn settling_twice_or_unknown_offsets_is_stale() {
        let mut t = Tracker::default();
        let g = t.deliver(&tp(), 1);
        t.settle(&tp(), 1, g).unwrap();
        assert_eq!(t.settle(&tp(), 1, g), Err(Stale));
        assert_eq!(t.settle(&(Arc::from("u"), 0), 1, 0), Err(Stale));
    }
}
