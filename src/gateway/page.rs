//! A page of a list, as OpenAI's list routes read it (`limit`, `order`, `after`) and write it
//! (`{"object": "list", "data", "first_id", "last_id", "has_more"}`).

use std::collections::HashMap;

use serde_json::{Value, json};

use super::error::ApiError;

/// Most entries one page holds.
const MAX_PAGE: usize = 100;

/// A page of a list: OpenAI's `limit`, `order` and `after`.
#[derive(Debug)]
pub struct Page {
    limit: usize,
    ascending: bool,
    after: Option<String>,
}

impl Page {
    pub fn read(query: &HashMap<String, String>, also: &[&str]) -> Result<Page, Box<ApiError>> {
        let bad = |param: &str, message: String| {
            Box::new(
                ApiError::new(400, "invalid_request_error", "invalid_request", message)
                    .with_param(param),
            )
        };
        if let Some(key) = query.keys().find(|k| {
            !matches!(k.as_str(), "limit" | "order" | "after") && !also.contains(&k.as_str())
        }) {
            return Err(bad(
                key,
                format!(
                    "{}: unknown query parameter (limit, order, after{} are)",
                    crate::protocol::text::one_line(key),
                    also.iter().map(|a| format!(", {a}")).collect::<String>()
                ),
            ));
        }
        let limit = match query.get("limit") {
            None => 20,
            Some(text) => match text.parse::<usize>() {
                Ok(n @ 1..=MAX_PAGE) => n,
                _ => return Err(bad("limit", format!("limit: must be 1 to {MAX_PAGE}"))),
            },
        };
        let ascending = match query.get("order").map(String::as_str) {
            None | Some("desc") => false,
            Some("asc") => true,
            Some(_) => return Err(bad("order", "order: must be asc or desc".into())),
        };
        Ok(Page {
            limit,
            ascending,
            after: query.get("after").cloned(),
        })
    }

    /// The page of `items` (oldest first) as OpenAI's list object.
    pub fn of(&self, mut items: Vec<Value>) -> Value {
        if !self.ascending {
            items.reverse();
        }
        let start = match &self.after {
            Some(after) => items
                .iter()
                .position(|item| item["id"].as_str() == Some(after))
                .map_or(items.len(), |i| i + 1),
            None => 0,
        };
        let rest = items.len().saturating_sub(start);
        let data: Vec<Value> = items.into_iter().skip(start).take(self.limit).collect();
        json!({
            "object": "list",
            "first_id": data.first().map(|item| item["id"].clone()),
            "last_id": data.last().map(|item| item["id"].clone()),
            "has_more": rest > data.len(),
            "data": data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_page_of_input_items_in_either_order() {
        let items: Vec<Value> = (0..5).map(|i| json!({"id": format!("i{i}")})).collect();
        let page = Page::read(&query(&[("limit", "2")]), &[])
            .unwrap()
            .of(items.clone());
        assert_eq!(page["data"], json!([{"id": "i4"}, {"id": "i3"}]));
        assert_eq!(page["has_more"], true);
        let page = Page::read(&query(&[("order", "asc"), ("after", "i2")]), &[])
            .unwrap()
            .of(items.clone());
        assert_eq!(page["data"], json!([{"id": "i3"}, {"id": "i4"}]));
        assert_eq!(
            (page["first_id"].clone(), page["has_more"].clone()),
            (json!("i3"), json!(false))
        );
        for bad in [
            query(&[("limit", "0")]),
            query(&[("limit", "101")]),
            query(&[("order", "up")]),
            query(&[("before", "x")]),
        ] {
            assert!(Page::read(&bad, &[]).is_err(), "{bad:?}");
        }
    }
}
