//! The host's base image cache: each image of the fleet's catalogue made present with its digest
//! (`vps.bootstrap`). An image is `<images>/<name>/disk.qcow2`. One whose bytes hash to the
//! catalogue's sha256 is kept; any other is fetched from its URL (`https://`, `http://` or
//! `file://`) into a temporary file beside it, hashed as it streams, and moved into place only
//! when the digest matches, so a VM never boots from a partial or substituted image.

use std::path::{Path, PathBuf};

use better_compute_proto::v1::ImageSource;
use sha2::Digest;
use tokio::io::AsyncWriteExt;

/// The largest image fetched.
pub const MAX_IMAGE_BYTES: u64 = 64 << 30;
/// How long one image's fetch may take.
pub const FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

/// What became of one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    /// The cache had it with its digest.
    Kept,
    /// It was fetched: this many bytes.
    Fetched(u64),
}

/// Whether `name` may name an image folder: what `instances.create` accepts.
fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty() && b.len() <= 64 && b[0].is_ascii_alphanumeric() && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b".-_".contains(c))
}

/// The image's file in the cache.
pub fn disk_of(dir: &Path, name: &str) -> PathBuf {
    dir.join(name).join("disk.qcow2")
}

/// The sha256 of a file (lowercase hex), or `None` when it cannot be read.
pub fn sha256_of(file: &Path) -> Option<String> {
    let mut h = sha2::Sha256::new();
    let mut r = std::fs::File::open(file).ok()?;
    std::io::copy(&mut r, &mut h).ok()?;
    Some(format!("{:x}", h.finalize()))
}

/// Makes `src` present in `dir` with its digest.
pub async fn ensure(dir: &Path, src: &ImageSource) -> Result<Cached, String> {
    if !valid_name(&src.name) {
        return Err(format!("{:?} is not an image name", src.name));
    }
    if src.sha256.len() != 64 || !src.sha256.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return Err(format!("the sha256 of image {} is not 64 lowercase hex digits", src.name));
    }
    if !["https://", "http://", "file://"].iter().any(|scheme| src.url.starts_with(scheme)) {
        return Err(format!("{}: an image URL is https://, http:// or file://", src.url));
    }
    let target = disk_of(dir, &src.name);
    let t = target.clone();
    if tokio::task::spawn_blocking(move || sha256_of(&t)).await.ok().flatten().as_deref() == Some(src.sha256.as_str()) {
        return Ok(Cached::Kept);
    }
    let folder = target.parent().expect("an image file is in its folder").to_owned();
    tokio::fs::create_dir_all(&folder).await.map_err(|e| format!("cannot make {}: {e}", folder.display()))?;
    let part = folder.join(".disk.qcow2.part");
    let fetched = tokio::time::timeout(FETCH_TIMEOUT, fetch(&src.url, &part))
        .await
        .unwrap_or_else(|_| Err(format!("the fetch took longer than {} s", FETCH_TIMEOUT.as_secs())));
    let outcome = match fetched {
        Ok((bytes, digest)) if digest == src.sha256 => match tokio::fs::rename(&part, &target).await {
            Ok(()) => Ok(Cached::Fetched(bytes)),
            Err(e) => Err(format!("cannot move the image into place: {e}")),
        },
        Ok((_, digest)) => Err(format!("{} has sha256 {digest}, not the catalogue's {}", src.url, src.sha256)),
        Err(e) => Err(e),
    };
    if outcome.is_err() {
        let _ = tokio::fs::remove_file(&part).await;
    }
    outcome
}

/// Streams `url` into `to`, hashing it: its length and sha256.
async fn fetch(url: &str, to: &Path) -> Result<(u64, String), String> {
    let mut out = tokio::fs::File::create(to).await.map_err(|e| format!("cannot write {}: {e}", to.display()))?;
    let mut h = sha2::Sha256::new();
    let mut bytes = 0u64;
    let mut take = |chunk: &[u8]| -> Result<(), String> {
        bytes += chunk.len() as u64;
        if bytes > MAX_IMAGE_BYTES {
            return Err(format!("{url} is larger than {MAX_IMAGE_BYTES} bytes"));
        }
        h.update(chunk);
        Ok(())
    };
    if let Some(path) = url.strip_prefix("file://") {
        let mut f = tokio::fs::File::open(path).await.map_err(|e| format!("{url}: {e}"))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = tokio::io::AsyncReadExt::read(&mut f, &mut buf).await.map_err(|e| format!("{url}: {e}"))?;
            if n == 0 {
                break;
            }
            take(&buf[..n])?;
            out.write_all(&buf[..n]).await.map_err(|e| format!("cannot write {}: {e}", to.display()))?;
        }
    } else {
        let client = better_compute_tls::http().build().map_err(|e| format!("HTTP client: {e}"))?;
        let mut resp = client.get(url).send().await.map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url} answered {}", resp.status()));
        }
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("{url}: {e}"))? {
            take(&chunk)?;
            out.write_all(&chunk).await.map_err(|e| format!("cannot write {}: {e}", to.display()))?;
        }
    }
    out.sync_all().await.map_err(|e| format!("cannot write {}: {e}", to.display()))?;
    Ok((bytes, format!("{:x}", h.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str, url: String, sha256: &str) -> ImageSource {
        ImageSource { name: name.into(), url, sha256: sha256.into() }
    }

    fn digest(b: &[u8]) -> String {
        format!("{:x}", sha2::Sha256::digest(b))
    }

    /// Serves `body` once per connection over plain HTTP on a loopback port.
    async fn serve(body: &'static [u8]) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut req = [0u8; 1024];
                let _ = tokio::io::AsyncReadExt::read(&mut s, &mut req).await;
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body).await;
            }
        });
        format!("http://{addr}/debian-12.qcow2")
    }

    #[tokio::test]
    async fn an_image_is_fetched_once_kept_while_its_digest_holds_and_never_placed_when_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("images");
        let origin = dir.path().join("origin.qcow2");
        std::fs::write(&origin, b"the first image").unwrap();
        let good = source("debian-12", format!("file://{}", origin.display()), &digest(b"the first image"));
        assert_eq!(ensure(&cache, &good).await, Ok(Cached::Fetched(15)));
        assert_eq!(std::fs::read(disk_of(&cache, "debian-12")).unwrap(), b"the first image");
        assert_eq!(ensure(&cache, &good).await, Ok(Cached::Kept), "the cache has it: nothing is fetched");
        // The source changed under the same digest: refused, and the cached image stays as it was.
        std::fs::write(&origin, b"a substituted image").unwrap();
        std::fs::write(disk_of(&cache, "debian-12"), b"corrupted").unwrap();
        let err = ensure(&cache, &good).await.unwrap_err();
        assert!(err.contains("not the catalogue's"), "{err}");
        assert_eq!(std::fs::read(disk_of(&cache, "debian-12")).unwrap(), b"corrupted", "nothing half-fetched is moved in");
        assert!(!cache.join("debian-12/.disk.qcow2.part").exists());
        // Over HTTP.
        let url = serve(b"served bytes").await;
        let over_http = source("ubuntu-24.04", url, &digest(b"served bytes"));
        assert_eq!(ensure(&cache, &over_http).await, Ok(Cached::Fetched(12)));
        assert_eq!(std::fs::read(disk_of(&cache, "ubuntu-24.04")).unwrap(), b"served bytes");
        // Bad input is refused before anything is touched.
        for bad in [source("../etc", "file:///etc/passwd".into(), &digest(b"")), source("x", "ftp://h/x".into(), &digest(b"")), source("x", "file:///x".into(), "ABC")] {
            assert!(ensure(&cache, &bad).await.is_err(), "{bad:?}");
        }
        assert!(!cache.join("x").exists() && !dir.path().join("etc").exists());
    }
}
