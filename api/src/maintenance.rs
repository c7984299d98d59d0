//! Maintenance mode (`/ojs/v1/admin/system/maintenance`): while it is on,
//! FETCH hands out nothing, scheduled jobs are not published and cron jobs
//! do not fire; PUSH still lands, ACK and NACK of active jobs still count.
//! It is kept in the job store, so every replica follows it: the process
//! that switched it at once, the others within a second (they read it at
//! each pass of their loop).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::auth::{Grant, Operation};
use crate::error::ApiError;
use crate::Api;

/// The store's key of the state.
const KEY: &str = "maintenance";

/// Maintenance mode as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Maintenance {
    /// Whether it is on.
    pub enabled: bool,
    /// Why, as the operator said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was switched on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// When the operator expects it to end (it does not end by itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at: Option<DateTime<Utc>>,
}

impl Api {
    /// Maintenance mode as this process follows it.
    pub fn maintenance(&self) -> Maintenance {
        self.maintenance
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether FETCH, the scheduler and cron are held.
    pub(crate) fn in_maintenance(&self) -> bool {
        self.maintenance
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .enabled
    }

    /// `GET /ojs/v1/admin/system/maintenance`.
    pub async fn read_maintenance(&self, grant: &Grant<'_>) -> Result<Maintenance, ApiError> {
        grant.allow(Operation::Admin)?;
        self.refresh_maintenance().await;
        Ok(self.maintenance())
    }

    /// `POST /ojs/v1/admin/system/maintenance`: switches it on (with a
    /// reason and the time it is expected to last) or off. Needs the
    /// `admin` operation on every queue: it holds them all.
    pub async fn set_maintenance(
        &self,
        grant: &Grant<'_>,
        enabled: bool,
        reason: Option<String>,
        expected: Option<Duration>,
    ) -> Result<Maintenance, ApiError> {
        grant.allow_everywhere(Operation::Admin)?;
        if reason.as_ref().is_some_and(|r| r.len() > 1_000) {
            return Err(ApiError::invalid("reason", "is at most 1000 bytes"));
        }
        let now = self.now();
        let state = if enabled {
            Maintenance {
                enabled,
                reason,
                started_at: Some(now),
                ends_at: expected
                    .and_then(|d| chrono::Duration::from_std(d).ok())
                    .map(|d| now + d),
            }
        } else {
            Maintenance::default()
        };
        let text = serde_json::to_string(&state).map_err(|e| {
            ApiError::Store(crate::store::StoreError::Internal {
                reason: e.to_string(),
            })
        })?;
        self.store
            .run(move |tx| tx.set_system(KEY, enabled.then_some(text.as_str())))
            .await?;
        *self.maintenance.lock().unwrap_or_else(|e| e.into_inner()) = state.clone();
        tracing::info!(
            enabled,
            token = grant.token_name().unwrap_or(""),
            "maintenance mode: {enabled}"
        );
        // A waiting FETCH answers now.
        self.workers().published.notify_waiters();
        Ok(state)
    }

    /// Reads the state from the store (another replica may have switched
    /// it); on a failure the last state read stands.
    pub(crate) async fn refresh_maintenance(&self) {
        match self.store.run(|tx| tx.system(KEY)).await {
            Ok(text) => {
                let state = text
                    .and_then(|t| serde_json::from_str::<Maintenance>(&t).ok())
                    .unwrap_or_default();
                *self.maintenance.lock().unwrap_or_else(|e| e.into_inner()) = state;
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading maintenance mode failed; the last state read stands");
            }
        }
    }
}
