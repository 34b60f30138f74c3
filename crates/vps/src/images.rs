//! The fleet's base image catalogue: each image a tenant may boot, with where hosts fetch it from
//! and the sha256 its bytes must hash to. `vps.bootstrap` carries the catalogue to every host,
//! which fetches what its cache lacks and reports any image it cannot have (the host is then
//! degraded). A change of the catalogue moves its generation and bootstraps every host again; each
//! host keeps its state until its new report comes.

use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use better_compute_runtime::work_queue;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

use crate::jobs::bootstraps::BOOTSTRAPS_KIND;

/// An image of the catalogue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageView {
    /// The name `instances.create` takes.
    pub name: String,
    /// Where hosts fetch it: `https://`, `http://` or `file://` (a path on each host).
    pub url: String,
    /// What its bytes hash to (lowercase hex).
    pub sha256: String,
    /// The record's version.
    pub version: i64,
}

/// `vpsImages.set`: an image's source and digest.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetImage {
    /// 1 to 64 of `a-z 0-9 . _ -`, starting with a letter or digit.
    pub name: String,
    /// `https://…`, `http://…` or `file:///…` (at most 2048 characters).
    pub url: String,
    /// The sha256 of the image's bytes, 64 lowercase hex digits.
    pub sha256: String,
}

const VIEW: &str = "SELECT name, url, sha256, version FROM vps_images";

fn view_of(r: &tokio_postgres::Row) -> ImageView {
    ImageView { name: r.get(0), url: r.get(1), sha256: r.get(2), version: r.get(3) }
}

fn check(req: &SetImage) -> Result<(), Error> {
    crate::instances::check_image_name(&req.name)?;
    if !["https://", "http://", "file://"].iter().any(|s| req.url.starts_with(s)) || req.url.len() > 2048 || req.url.chars().any(char::is_whitespace) {
        return Err(Error::invalid_argument("url must be https://, http:// or file:// (at most 2048 characters, no spaces)"));
    }
    if req.sha256.len() != 64 || !req.sha256.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return Err(Error::invalid_argument("sha256 must be 64 lowercase hex digits (`sha256sum` of the image)"));
    }
    Ok(())
}

/// Every image, by name.
pub async fn list(db: &impl GenericClient) -> Result<Vec<ImageView>, DbError> {
    Ok(db.query(&format!("{VIEW} ORDER BY name"), &[]).await?.iter().map(view_of).collect())
}

/// The catalogue as `vps.bootstrap` carries it, and its generation.
pub(crate) async fn catalogue(db: &impl GenericClient) -> Result<(i64, serde_json::Value), DbError> {
    let generation: i64 = db.query_one("SELECT catalogue_generation FROM vps_settings", &[]).await?.get(0);
    let sources: Vec<serde_json::Value> = list(db).await?.into_iter().map(|i| serde_json::json!({"name": i.name, "url": i.url, "sha256": i.sha256})).collect();
    Ok((generation, serde_json::json!({"sources": sources})))
}

/// Adds an image or changes its source or digest, in the caller's transaction; setting what is
/// already there changes nothing (no new generation, no bootstrap).
pub async fn set(tx: &impl GenericClient, req: &SetImage) -> Result<ImageView, Error> {
    check(req)?;
    let changed = tx
        .query_opt(
            "INSERT INTO vps_images (name, url, sha256) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE SET url = excluded.url, sha256 = excluded.sha256, version = vps_images.version + 1, updated_at = compute_now()
              WHERE (vps_images.url, vps_images.sha256) IS DISTINCT FROM (excluded.url, excluded.sha256)
             RETURNING name, url, sha256, version",
            &[&req.name, &req.url, &req.sha256],
        )
        .await
        .map_err(DbError::from)?;
    let Some(row) = changed else {
        let row = tx.query_one(&format!("{VIEW} WHERE name = $1"), &[&req.name]).await.map_err(DbError::from)?;
        return Ok(view_of(&row));
    };
    let v = view_of(&row);
    changed_catalogue(tx, "vps.image.set", &v.name, serde_json::json!({"url": v.url, "sha256": v.sha256, "version": v.version})).await?;
    Ok(v)
}

/// Takes an image out of the catalogue (hosts keep their cached copy: VMs made from it still run).
pub async fn delete(tx: &impl GenericClient, name: &str) -> Result<(), Error> {
    let gone = tx.execute("DELETE FROM vps_images WHERE name = $1", &[&name]).await.map_err(DbError::from)?;
    if gone == 0 {
        return Err(Error::new(ErrorCode::NotFound, format!("image {name:?} is not in the catalogue")));
    }
    changed_catalogue(tx, "vps.image.deleted", name, serde_json::json!({})).await
}

/// A new catalogue generation: its event, and every host bootstrapped again.
async fn changed_catalogue(tx: &impl GenericClient, event_type: &str, name: &str, data: serde_json::Value) -> Result<(), Error> {
    tx.execute("UPDATE vps_settings SET catalogue_generation = catalogue_generation + 1", &[]).await.map_err(DbError::from)?;
    let hosts: Vec<String> = tx.query("SELECT node_id FROM vps_hosts ORDER BY node_id", &[]).await.map_err(DbError::from)?.iter().map(|r| r.get(0)).collect();
    work_queue::enqueue_many(tx, &BOOTSTRAPS_KIND, &hosts).await?;
    outbox::emit(tx, NewEvent { event_type, tenant_id: None, subject: name, data }).await?;
    Ok(())
}
