//! Cursor pagination: every list takes `pageSize` and `pageToken` and answers with `items` and
//! `nextPageToken` (absent on the last page). The token is the last item's id: ids sort by
//! creation, so a page is `WHERE id > $token ORDER BY id LIMIT $size`, stable under inserts.

use serde::{Deserialize, Serialize};

use crate::Error;

/// The default page size.
pub const DEFAULT_PAGE_SIZE: i64 = 100;
/// The largest page size.
pub const MAX_PAGE_SIZE: i64 = 500;

/// A page request's two fields, as every list method takes them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PageRequest {
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    pub page_size: Option<i64>,
    /// `nextPageToken` of the previous page; absent for the first.
    #[serde(default)]
    pub page_token: Option<String>,
}

impl PageRequest {
    /// The size to read (checked), and the id to start after (`""` for the first page).
    pub fn bounds(&self) -> Result<(i64, String), Error> {
        let size = self.page_size.unwrap_or(DEFAULT_PAGE_SIZE);
        if !(1..=MAX_PAGE_SIZE).contains(&size) {
            return Err(Error::invalid_argument(format!("pageSize must be between 1 and {MAX_PAGE_SIZE}")));
        }
        let after = self.page_token.clone().unwrap_or_default();
        if after.len() > 200 {
            return Err(Error::invalid_argument("pageToken is not one this API issued"));
        }
        Ok((size, after))
    }
}

/// One page of a list.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "{T}Page")]
pub struct Page<T> {
    /// The items, in id order.
    pub items: Vec<T>,
    /// Pass as `pageToken` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

impl<T> Page<T> {
    /// A page from `size + 1` rows read: the extra row only says that there is more.
    pub fn from_rows(mut items: Vec<T>, size: i64, id: impl Fn(&T) -> String) -> Page<T> {
        let more = items.len() as i64 > size;
        items.truncate(size as usize);
        let next_page_token = if more { items.last().map(id) } else { None };
        Page { items, next_page_token }
    }
}
