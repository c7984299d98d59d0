//! Rate limits as operators see and steer them: the keys the store keeps
//! (`GET /ojs/v1/rate-limits`), an override of a key's limits (`PUT
//! /ojs/v1/rate-limits/{key}`, removed by `DELETE …/{key}/override`), and a
//! queue's configuration (`PUT /ojs/v1/admin/queues/{name}/config`, `…/
//! rate-limit`), whose limits every job of the queue starts under.
//!
//! A token scoped to queues sees and steers the keys of its queues
//! (`queue:<name>`) only; other keys are not its to know of.
//! Queue configurations are kept in the job store; the process alone on
//! its store keeps them in memory as it changes them, replicas read them
//! with the paused queues (`crate::queues`).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::{json, Map, Value};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::model::rate::{check_key, effective, Limits, Override};
use crate::model::{self};
use crate::store::{record_of, record_text, RateKeyView};
use crate::Api;

/// Keys a scoped token's listing looks at, at most (its page is cut from
/// those it may see).
const SCOPED_SCAN: u64 = 10_000;

/// The queue a key limits, for a key of a queue (`queue:<name>`).
fn queue_of(key: &str) -> Option<&str> {
    key.strip_prefix("queue:")
}

fn sees_key(grant: &Grant<'_>, key: &str) -> bool {
    grant.scope().is_empty() || queue_of(key).is_some_and(|q| grant.sees(q))
}

fn unknown_key(key: &str) -> ApiError {
    ApiError::NotFound {
        resource_type: "rate_limit",
        resource_id: key.to_owned(),
    }
}

impl Api {
    /// The limits of `queue`'s configuration, if it has any (this is
    /// every FETCH: read from memory).
    pub(crate) fn queue_limits(&self, queue: &str) -> Option<Limits> {
        self.queue_limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .cloned()
    }

    /// Replaces the configurations kept here with those `records` hold.
    pub(crate) fn keep_queue_configs(&self, records: Vec<(String, String)>) {
        let mut kept = HashMap::with_capacity(records.len());
        for (name, record) in records {
            match record_of::<Limits>(&name, &record) {
                Ok(limits) => {
                    kept.insert(name, limits);
                }
                Err(e) => {
                    tracing::warn!(queue = %name, error = %e, "a stored queue configuration does not decode; the queue has none");
                }
            }
        }
        *self.queue_limits.lock().unwrap_or_else(|e| e.into_inner()) = kept;
    }

    /// `GET /ojs/v1/admin/queues/{name}` `configuration`: the queue's
    /// limits (none set: all `null`).
    pub async fn queue_config(&self, grant: &Grant<'_>, queue: &str) -> Result<Value, ApiError> {
        grant.allow_on(Operation::Read, queue)?;
        if self.replication.id().is_some() {
            self.refresh_paused().await;
        }
        let limits = self.queue_limits(queue).unwrap_or_default();
        Ok(model::queue::to_json(&limits, self.settings.retention))
    }

    /// `PUT /ojs/v1/admin/queues/{name}/config` (`{concurrency,
    /// rate_limit, retention}`) and `…/rate-limit` (`{limit, period}` or
    /// `null`): changes what the body names, keeps the rest; answers the
    /// configuration as it became.
    pub async fn set_queue_config(
        &self,
        grant: &Grant<'_>,
        queue: &str,
        body: Value,
    ) -> Result<Value, ApiError> {
        self.admin_on_queue(grant, queue)?;
        let retention = self.settings.retention;
        let name = queue.to_owned();
        let stored = self.store.run(|tx| tx.queue_configs()).await?;
        let current = stored
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(n, r)| record_of::<Limits>(&n, &r))
            .transpose()?
            .unwrap_or_default();
        let limits = model::queue::read(&current, &body, retention)?;
        let record = record_text(&name, &limits)?;
        self.store
            .run(move |tx| tx.save_queue_config(&name, &record))
            .await?;
        self.queue_limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), limits.clone());
        tracing::info!(%queue, token = grant.token_name().unwrap_or(""), "queue configuration changed");
        Ok(model::queue::to_json(&limits, retention))
    }

    /// `GET /ojs/v1/rate-limits`: the keys in use (or overridden), by key,
    /// a page of them and how many there are.
    pub async fn rate_limits(
        &self,
        grant: &Grant<'_>,
        page: usize,
        per_page: usize,
    ) -> Result<(Vec<RateKeyView>, u64), ApiError> {
        grant.allow(Operation::Read)?;
        let offset = (page.saturating_sub(1) * per_page) as u64;
        let limit = per_page as u64;
        let scoped = !grant.scope().is_empty();
        let (keys, total) = self
            .store
            .run(move |tx| {
                // A scoped token's page is cut from the keys it may see.
                let (keys, total) = if scoped {
                    tx.rate_keys(0, SCOPED_SCAN)?
                } else {
                    tx.rate_keys(offset, limit)?
                };
                let mut out = Vec::with_capacity(keys.len());
                for (key, state) in keys {
                    let (active, waiting) = tx.rate_jobs(&key)?;
                    out.push(RateKeyView {
                        key,
                        state,
                        active,
                        waiting,
                    });
                }
                Ok((out, total))
            })
            .await?;
        if scoped {
            let seen: Vec<RateKeyView> = keys
                .into_iter()
                .filter(|k| sees_key(grant, &k.key))
                .collect();
            let total = seen.len() as u64;
            let page = seen
                .into_iter()
                .skip(usize::try_from(offset).unwrap_or(usize::MAX))
                .take(per_page)
                .collect();
            return Ok((page, total));
        }
        Ok((keys, total))
    }

    /// `GET /ojs/v1/rate-limits/{key}`.
    pub async fn rate_limit(&self, grant: &Grant<'_>, key: &str) -> Result<RateKeyView, ApiError> {
        grant.allow(Operation::Read)?;
        if !sees_key(grant, key) {
            return Err(unknown_key(key));
        }
        let k = key.to_owned();
        let view = self
            .store
            .run(move |tx| {
                let Some(state) = tx.peek_rate_key(&k)? else {
                    return Ok(None);
                };
                let (active, waiting) = tx.rate_jobs(&k)?;
                Ok(Some(RateKeyView {
                    key: k,
                    state,
                    active,
                    waiting,
                }))
            })
            .await?;
        view.ok_or_else(|| unknown_key(key))
    }

    /// `PUT /ojs/v1/rate-limits/{key}`: an override of the key's limits
    /// (`{concurrency?, limit?, period?, rate?, throttle?, expires_at?}`),
    /// in place of its jobs' own until it expires or is removed; `None`
    /// removes it (`DELETE …/{key}/override`).
    pub async fn override_rate_limit(
        &self,
        grant: &Grant<'_>,
        key: &str,
        body: Option<Value>,
    ) -> Result<RateKeyView, ApiError> {
        grant.allow(Operation::Admin)?;
        check_key("key", key)?;
        if !sees_key(grant, key) {
            return Err(grant
                .allow_on(Operation::Admin, queue_of(key).unwrap_or(key))
                .err()
                .unwrap_or_else(|| unknown_key(key)));
        }
        let now = self.now();
        let overridden = body.map(|b| read_override(&b, now)).transpose()?;
        let k = key.to_owned();
        let view = self
            .store
            .run(move |tx| {
                let mut state = tx.rate_key(&k)?.unwrap_or_default();
                state.overridden = overridden;
                tx.save_rate_key(&k, &state, now)?;
                let (active, waiting) = tx.rate_jobs(&k)?;
                Ok(RateKeyView {
                    key: k,
                    state,
                    active,
                    waiting,
                })
            })
            .await?;
        tracing::info!(key = %key, token = grant.token_name().unwrap_or(""), overridden = view.state.overridden.is_some(), "rate-limit override changed");
        Ok(view)
    }
}

/// Reads an override: the admin UI's flat `{limit, period}` for a rate, or
/// the spec's `concurrency`, `rate`, `throttle`; `expires_at` (RFC 3339, in
/// the future).
fn read_override(body: &Value, now: DateTime<Utc>) -> Result<Override, ApiError> {
    let Value::Object(m) = body else {
        return Err(ApiError::invalid("body", "must be a JSON object"));
    };
    let mut limits_body = Map::new();
    let mut expires_at = None;
    for (k, v) in m {
        match k.as_str() {
            "concurrency" | "rate" | "throttle" | "max_per_second" => {
                limits_body.insert(k.clone(), v.clone());
            }
            "limit" | "period" => {}
            "expires_at" => {
                expires_at = match v {
                    Value::Null => None,
                    Value::String(s) => {
                        let at = DateTime::parse_from_rfc3339(s)
                            .map_err(|e| ApiError::invalid("expires_at", e.to_string()))?
                            .with_timezone(&Utc);
                        if at <= now {
                            return Err(ApiError::invalid("expires_at", "must be in the future"));
                        }
                        Some(at)
                    }
                    _ => return Err(ApiError::invalid("expires_at", "must be an RFC 3339 time")),
                }
            }
            // What the admin UI shows of a key and may send back.
            "key" | "active" | "waiting" | "override" => {}
            other => {
                return Err(ApiError::invalid(
                    other,
                    format!("{other:?} is not a field of a rate-limit override (concurrency, rate, throttle, limit, period, expires_at)"),
                ))
            }
        }
    }
    if m.contains_key("limit") || m.contains_key("period") {
        if limits_body.contains_key("rate") {
            return Err(ApiError::invalid(
                "rate",
                "gives both `rate` and `limit`/`period`; give one",
            ));
        }
        limits_body.insert(
            "rate".into(),
            json!({"limit": m.get("limit").cloned().unwrap_or(Value::Null), "period": m.get("period").cloned().unwrap_or(Value::Null)}),
        );
    }
    let limits = Limits::read("override", &limits_body)?;
    if limits == Limits::default() {
        return Err(ApiError::invalid(
            "override",
            "needs `concurrency`, `limit` and `period`, `rate` or `throttle`",
        ));
    }
    Ok(Override { limits, expires_at })
}

/// A key as the endpoints answer it: the spec's nested fields and the
/// admin UI's flat ones.
pub fn key_json(view: &RateKeyView, now: DateTime<Utc>) -> Value {
    let held = effective(&view.state.limits, &view.state, now);
    let rate_json = held.rate.as_ref().map(|r| {
        let period_ms = i64::try_from(r.period().as_millis()).unwrap_or(i64::MAX);
        let current = view
            .state
            .window_start_ms
            .filter(|start| now.timestamp_millis() < start.saturating_add(period_ms));
        json!({
            "limit": r.limit,
            "period": r.period,
            "current_count": current.map_or(0, |_| view.state.window_count),
            "window_resets_at": current.and_then(|s| DateTime::from_timestamp_millis(s.saturating_add(period_ms))).map(crate::job::timestamp),
        })
    });
    let overridden = view
        .state
        .overridden
        .as_ref()
        .filter(|o| o.expires_at.is_none_or(|at| now < at));
    json!({
        "key": view.key,
        "concurrency": held.concurrency.map(|c| json!({
            "limit": c,
            "active": view.active,
            "available": u64::from(c).saturating_sub(view.active),
        })),
        "rate": rate_json,
        "throttle": held.throttle.as_ref().map(|t| json!({"limit": t.limit, "period": t.period})),
        "waiting_count": view.waiting,
        "limit": held.rate.as_ref().map(|r| r.limit).or(held.concurrency),
        "period": held.rate.as_ref().map(|r| r.period.clone()),
        "active": view.active,
        "waiting": view.waiting,
        "override": overridden.map(|o| json!({
            "limit": o.limits.rate.as_ref().map(|r| r.limit).or(o.limits.concurrency),
            "period": o.limits.rate.as_ref().map(|r| r.period.clone()),
            "concurrency": o.limits.concurrency,
            "expires_at": o.expires_at.map(crate::job::timestamp),
        })),
    })
}
