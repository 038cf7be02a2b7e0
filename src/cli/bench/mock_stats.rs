//! The bench's mock backend counts what it generated (`/mock/stats`): beside the results'
//! outputs, it says how much text was generated again after a worker died or handed its
//! requests off.

/// The mock's `/mock/stats`: what it generated since the last reset.
pub struct MockStats {
    http: reqwest::Client,
    url: String,
}

impl MockStats {
    pub fn new(backend_url: &str) -> MockStats {
        let base = backend_url.trim_end_matches('/').trim_end_matches("/v1");
        MockStats {
            http: reqwest::Client::new(),
            url: format!("{base}/mock/stats"),
        }
    }

    pub async fn reset(&self) -> anyhow::Result<()> {
        self.http
            .delete(&self.url)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    pub async fn read(&self) -> anyhow::Result<crate::llm::mock::GeneratedStats> {
        let stats: serde_json::Value = self
            .http
            .get(&self.url)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(serde_json::from_value(stats["generated"].clone())?)
    }
}
