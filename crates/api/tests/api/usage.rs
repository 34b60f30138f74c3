//! Usage through the API: a tenant's own windows, every tenant's only at fleet scope.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_list_sums_a_tenants_own_windows_and_every_tenants_only_at_fleet_scope() {
    // One window per page, so the streamed export walks several pages.
    let api = Api::start_with(|s| s.usage_export_page_rows = 1).await;
    let b = api.tenant("tenant-b").await;
    let c = api.tenant("tenant-c").await;
    better_compute_capacity::usage::set_window_s(&api.h.db().connect().await, 60).await.unwrap();
    let res = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("u-1"))).await;
    assert_eq!(res["state"], "placed", "{res}");
    // The placement wakes the pool's metering, which arms itself for each window's end.
    let c0 = api.h.db().connect().await;
    for _ in 0..2000 {
        let settled: bool = c0.query_one("SELECT coalesce(max(txid) < pg_snapshot_xmin(pg_current_snapshot()), true) FROM outbox", &[]).await.unwrap().get(0);
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    api.h.job("event-subscribers").drain(20).await;
    api.h.job("capacity.usage").drain(10).await;
    for _ in 0..3 {
        api.h.db().advance(Duration::from_secs(61)).await;
        api.h.job("capacity.usage").drain(10).await;
    }
    let body = json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "reservation"});
    let mine = api.ok(&b.token, "usage.list", body.clone()).await;
    let items = mine["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{mine}");
    assert_eq!((items[0]["group"].as_str(), mine["windowS"].as_i64()), (res["id"].as_str(), Some(60)));
    assert!(items[0]["windows"].as_i64().unwrap() >= 2 && items[0]["atomSeconds"].as_f64().unwrap() > 0.0, "{mine}");
    // Another tenant sees none of it, and cannot ask for every tenant's.
    assert_eq!(api.ok(&c.token, "usage.list", body.clone()).await["items"], json!([]));
    let mut all = body.clone();
    all["allTenants"] = json!(true);
    let (s, v) = api.call(&c.token, "usage.list", all.clone()).await;
    assert!(s == 403 || s == 404, "{v}");
    // An operator with fleet scope sums every tenant's, by day.
    all["groupBy"] = json!("day");
    let fleet = api.ok(&api.op, "usage.list", all).await;
    assert_eq!(fleet["items"].as_array().unwrap().len(), 1, "{fleet}");
    assert_eq!(fleet["items"][0]["tenantId"], b.id.as_str());
    // The export: every window, one by one, a page at a time; the sum is the list's.
    let mut keys = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut q = json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "pageSize": 1});
        if let Some(t) = &token {
            q["pageToken"] = json!(t);
        }
        let page = api.ok(&b.token, "usage.export", q).await;
        keys.extend(page["items"].as_array().unwrap().iter().map(|w| w["key"].as_str().unwrap().to_owned()));
        match page["nextPageToken"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    assert_eq!(keys.len() as i64, items[0]["windows"].as_i64().unwrap());
    assert!(keys.windows(2).all(|w| w[0] < w[1]) && keys[0].starts_with(&format!("cmp:{}:", res["id"].as_str().unwrap())), "{keys:?}");
    // The streamed export: the same rows, whole, as CSV (a header first) or JSON lines.
    let stream = async |token: &str, query: &str| {
        let r = api.http.get(format!("{}/v1/usage.export?{query}", api.url)).bearer_auth(token).send().await.unwrap();
        let ct = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        (r.status().as_u16(), ct, r.text().await.unwrap())
    };
    let period = "from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z";
    let (s, ct, csv) = stream(&b.token, period).await;
    assert_eq!((s, ct.as_str()), (200, "text/csv; charset=utf-8"), "{csv}");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), keys.len() + 1, "{csv}");
    assert!(lines[0].starts_with("key,reservationId,tenantId,"), "{csv}");
    assert_eq!(lines[1..].iter().map(|l| l.split(',').next().unwrap()).collect::<Vec<_>>(), keys, "{csv}");
    assert!(lines[1..].iter().all(|l| l.split(',').nth(2) == Some(b.id.as_str())), "{csv}");
    let (s, ct, jsonl) = stream(&b.token, &format!("{period}&format=jsonl&after={}", keys[0])).await;
    assert_eq!((s, ct.as_str()), (200, "application/x-ndjson"), "{jsonl}");
    let resumed: Vec<String> = jsonl.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["key"].as_str().unwrap().to_owned()).collect();
    assert_eq!(resumed, keys[1..], "resuming after the first key streams the rest");
    // Another tenant streams nothing of it, and every tenant's only at fleet scope.
    let (s, _, other) = stream(&c.token, period).await;
    assert_eq!((s, other.lines().count()), (200, 1), "{other}");
    let (s, _, refused) = stream(&c.token, &format!("{period}&allTenants=true")).await;
    assert!(s == 403 || s == 404, "{refused}");
    let (s, _, fleet) = stream(&api.op, &format!("{period}&allTenants=true&format=jsonl")).await;
    assert_eq!((s, fleet.lines().count()), (200, keys.len()), "{fleet}");
    // Bad input is a JSON error before any row.
    for bad in ["from=yesterday&to=2100-01-01T00:00:00Z", "to=2100-01-01T00:00:00Z", &format!("{period}&format=xml"), &format!("{period}&limit=5")] {
        let (s, ct, body) = stream(&b.token, bad).await;
        assert_eq!((s, ct.as_str()), (400, "application/json"), "{bad}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["code"], "INVALID_ARGUMENT", "{bad}: {body}");
    }
    let (s, _, _) = stream("bct_nope", period).await;
    assert_eq!(s, 401);
    let (_, v) = api.call(&b.token, "usage.list", json!({"from": "yesterday", "to": "2100-01-01T00:00:00Z", "groupBy": "pool"})).await;
    assert_eq!(v["code"], "INVALID_ARGUMENT", "{v}");
    // Instance usage reads the same way (no instance ran here: its windows are the vps tests').
    let ins = api.ok(&b.token, "instanceUsage.list", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "flavour"})).await;
    assert_eq!((ins["items"].clone(), ins["windowS"].as_i64()), (json!([]), Some(60)), "{ins}");
    let page = api.ok(&api.op, "instanceUsage.export", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "allTenants": true})).await;
    assert_eq!(page["items"], json!([]), "{page}");
    let (s, v) = api.call(&c.token, "instanceUsage.export", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "allTenants": true})).await;
    assert!(s == 403 || s == 404, "{v}");
    let (_, v) = api.call(&b.token, "instanceUsage.list", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "model"})).await;
    assert_eq!(v["code"], "INVALID_ARGUMENT", "{v}");
}
