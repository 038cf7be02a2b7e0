//! The request checker: a request is checked once, as the Supervisor accepts it, before
//! anything is written for it.

use std::sync::Arc;

use crate::engine::Engine;
use crate::protocol::ids::new_id;
use crate::protocol::{GenerationRequest, RequestLimits, WireError};
use crate::settings::Settings;

/// The bounds a request is checked against on acceptance, from the settings.
pub fn request_limits(settings: &Settings) -> RequestLimits {
    RequestLimits {
        max_metadata_bytes: settings.limits.max_metadata_bytes,
        max_tool_iterations: settings.generation.max_tool_iterations,
        ..RequestLimits::default()
    }
}

/// A request checked for acceptance: its fields within the limits and every tool it names
/// known. Only a [`RequestChecker`] makes one, so a request is checked once, before anything is
/// written for it, and the Supervisor takes it as it is.
#[derive(Debug, Clone)]
pub struct CheckedRequest(GenerationRequest);

impl CheckedRequest {
    pub fn request(&self) -> &GenerationRequest {
        &self.0
    }

    /// Its id (a checked request always has one).
    pub fn request_id(&self) -> &str {
        self.0.request_id.as_deref().unwrap_or_default()
    }

    pub fn into_request(self) -> GenerationRequest {
        self.0
    }

    /// The request under its id on the bus: `<tenant>.<id>` for a tenant other than the
    /// default, so that the same id in two tenants is two requests (see
    /// [`crate::protocol::schedule::qualified_id`]). Its id was checked bare.
    pub fn qualified(mut self, tenant: Option<&str>) -> CheckedRequest {
        let id = crate::protocol::schedule::qualified_id(tenant, self.request_id());
        self.0.request_id = Some(id);
        self
    }
}

/// Checks requests as the Supervisor accepts them: the limits from the settings and the tools
/// the engine knows now.
#[derive(Clone)]
pub struct RequestChecker {
    limits: RequestLimits,
    engine: Arc<Engine>,
}

impl RequestChecker {
    pub fn new(limits: RequestLimits, engine: Arc<Engine>) -> RequestChecker {
        RequestChecker { limits, engine }
    }

    /// Whether a turn of `request` cut short is continued here rather than taken again.
    pub fn continues_turns(&self, request: &GenerationRequest) -> bool {
        self.engine.continues_turns(request)
    }

    /// Checks a request, giving it a fresh id when it has none.
    pub fn check(&self, mut request: GenerationRequest) -> Result<CheckedRequest, WireError> {
        request.request_id.get_or_insert_with(new_id);
        request.validate(&self.limits)?;
        self.engine.check_request(&request)?;
        Ok(CheckedRequest(request))
    }
}
