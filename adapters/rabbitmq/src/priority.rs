//! OJS priorities (−100…100, higher first, 0 the default) as AMQP
//! priorities (0…`x-max-priority`, higher first).
//!
//! AMQP has no rank below 0, and a message published without one ranks 0:
//! mapping OJS 0 to AMQP 0 would rank every negative priority with the
//! default. So 0 takes the middle rank, −100…−1 share the ranks below it
//! and 1…100 the ranks above it, in equal steps, and any priority other
//! than 0 moves off the middle: with the default 10 ranks LOW (−10),
//! NORMAL (0) and HIGH (10) are 4, 5 and 6. A queue declared with more
//! ranks orders more finely (200 gives each OJS step its own).

/// The OJS range; priorities outside it (the daemon carries envelopes of
/// other producers) rank as its ends.
const OJS_MAX: i32 = 100;

/// The rank of OJS 0 on a queue with ranks 0…`max`.
fn middle(max: u8) -> i32 {
    i32::from(max) / 2
}

/// The AMQP rank of OJS `priority` on a queue with ranks 0…`max`.
pub(crate) fn rank(priority: i32, max: u8) -> u8 {
    let p = priority.clamp(-OJS_MAX, OJS_MAX);
    let mid = middle(max);
    // Ranks on the side of `p`, and how far from the middle it goes: the
    // ceiling, so that 1 and −1 already leave the middle.
    let side = if p > 0 { i32::from(max) - mid } else { mid };
    let steps = (p.abs() * side + OJS_MAX - 1) / OJS_MAX;
    let r = if p >= 0 { mid + steps } else { mid - steps };
    // In 0…max by construction; the clamp keeps the cast honest.
    r.clamp(0, i32::from(max)) as u8
}

/// The OJS priority a copy of a message with AMQP rank `r` goes out with:
/// the smallest in magnitude that ranks `r` again, so that a job retried
/// or dead-lettered keeps its place however often it is copied.
pub fn ojs_priority(r: u8, max: u8) -> i32 {
    let r = i32::from(r.min(max));
    let mid = middle(max);
    let (side, steps) = if r >= mid {
        (i32::from(max) - mid, r - mid)
    } else {
        (mid, mid - r)
    };
    if steps == 0 || side == 0 {
        return 0;
    }
    // Smallest |p| with ceil(|p|·side/100) ≥ steps.
    let magnitude = ((steps - 1) * OJS_MAX / side + 1).min(OJS_MAX);
    if r >= mid {
        magnitude
    } else {
        -magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_levels_rank_apart_on_the_default_queue() {
        assert_eq!((rank(-10, 10), rank(0, 10), rank(10, 10)), (4, 5, 6));
        assert_eq!((rank(-100, 10), rank(100, 10)), (0, 10));
        assert_eq!((rank(-1, 10), rank(1, 10)), (4, 6), "off the middle");
        assert_eq!((rank(i32::MIN, 10), rank(i32::MAX, 10)), (0, 10));
    }

    #[test]
    fn every_queue_size_keeps_order_and_every_copy_keeps_its_rank() {
        for max in 1..=u8::MAX {
            let mut last = 0;
            for p in -OJS_MAX..=OJS_MAX {
                let r = rank(p, max);
                assert!(r >= last, "max {max}: {p} ranks below {}", p - 1);
                last = r;
                assert_eq!(
                    rank(ojs_priority(r, max), max),
                    r,
                    "max {max}, priority {p}"
                );
            }
            if max >= 2 {
                assert!(rank(-1, max) < rank(0, max) && rank(0, max) < rank(1, max));
            }
        }
    }

    #[test]
    fn a_rank_no_ojs_priority_reaches_reads_as_the_nearest() {
        // 255 ranks: 127 below the middle for 100 negative priorities.
        let p = ojs_priority(255, 255);
        assert_eq!(p, 100);
        assert_eq!(ojs_priority(0, 255), -100);
        assert_eq!(ojs_priority(9, 10), ojs_priority(9, 10).clamp(-100, 100));
    }
}
