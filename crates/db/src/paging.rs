//! One page of a list, by id: every list method's query, in one place.

use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};

use crate::DbError;

/// The page of `select … WHERE filter` that `page` asks for, in `id` order. `filter` reads
/// `$1..$n` from `params`; the page's bounds follow them. `select` must expose an unqualified `id`.
pub async fn read_page<T>(
    db: &impl GenericClient,
    select: &str,
    filter: &str,
    params: &[&(dyn ToSql + Sync)],
    page: &PageRequest,
    map: impl Fn(&Row) -> T,
    id: impl Fn(&T) -> String,
) -> Result<Page<T>, Error> {
    let (size, after) = page.bounds()?;
    let limit = size + 1;
    let n = params.len();
    let sql = format!("{select} WHERE ({filter}) AND id > ${} ORDER BY id LIMIT ${}", n + 1, n + 2);
    let mut all = params.to_vec();
    all.push(&after);
    all.push(&limit);
    let rows = db.query(&sql, &all).await.map_err(DbError::from)?;
    Ok(Page::from_rows(rows.iter().map(map).collect(), size, id))
}
