//! The page, embedded in the binary: plain HTML, CSS and JavaScript, no build step and nothing
//! loaded from elsewhere.

pub const INDEX_HTML: &str = include_str!("assets/index.html");
pub const APP_JS: &str = include_str!("assets/app.js");
pub const APP_CSS: &str = include_str!("assets/app.css");
pub const FAVICON_SVG: &str = include_str!("assets/favicon.svg");
