//! An ordinary tonic service, used by the example binary and by the tests
//! of `ojs-grpc`: nothing here knows about queues.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tonic::{Request, Response, Status};

/// Code generated from `proto/invoices.proto`.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod pb {
    tonic::include_proto!("invoices.v1");
}

/// `proto/invoices.proto` as a FileDescriptorSet (what a daemon route's
/// `descriptor_set` reads).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/invoices.binpb"));

pub use pb::invoices_client::InvoicesClient;
pub use pb::invoices_server::{Invoices, InvoicesServer};

/// Invoices kept in memory.
#[derive(Debug, Clone, Default)]
pub struct InvoiceBook {
    invoices: Arc<Mutex<HashMap<String, pb::Invoice>>>,
    by_key: Arc<Mutex<HashMap<String, String>>>,
    created: Arc<AtomicU64>,
}

impl InvoiceBook {
    /// Invoices created so far (an idempotent repeat creates none).
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl Invoices for InvoiceBook {
    async fn create(
        &self,
        request: Request<pb::CreateInvoiceRequest>,
    ) -> Result<Response<pb::Invoice>, Status> {
        let req = request.into_inner();
        if req.customer.is_empty() {
            return Err(Status::invalid_argument("customer is required"));
        }
        if req.amount_cents <= 0 {
            return Err(Status::invalid_argument("amount_cents must be positive"));
        }
        let mut by_key = by_key_lock(&self.by_key)?;
        let mut invoices = by_key_lock(&self.invoices)?;
        if let Some(id) = by_key
            .get(&req.idempotency_key)
            .filter(|_| !req.idempotency_key.is_empty())
        {
            if let Some(existing) = invoices.get(id) {
                return Ok(Response::new(existing.clone()));
            }
        }
        let n = self.created.fetch_add(1, Ordering::Relaxed) + 1;
        let invoice = pb::Invoice {
            id: format!("inv-{n}"),
            customer: req.customer,
            amount_cents: req.amount_cents,
        };
        if !req.idempotency_key.is_empty() {
            by_key.insert(req.idempotency_key, invoice.id.clone());
        }
        invoices.insert(invoice.id.clone(), invoice.clone());
        Ok(Response::new(invoice))
    }

    async fn get(
        &self,
        request: Request<pb::GetInvoiceRequest>,
    ) -> Result<Response<pb::Invoice>, Status> {
        let id = request.into_inner().id;
        by_key_lock(&self.invoices)?
            .get(&id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no invoice {id}")))
    }
}

fn by_key_lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Status> {
    m.lock()
        .map_err(|_| Status::internal("invoice book poisoned"))
}
