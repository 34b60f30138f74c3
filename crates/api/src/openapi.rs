//! The OpenAPI 3.0 document, generated from the methods' own request and response types.

use better_compute_core::ErrorCode;
use schemars::generate::SchemaSettings;
use serde_json::{json, Value};

use crate::Method;

/// The document for `methods`.
pub fn document<'a>(methods: impl IntoIterator<Item = &'a Method>) -> Value {
    let mut generator = SchemaSettings::openapi3().into_generator();
    let error = generator.subschema_for::<better_compute_core::Error>();
    let mut paths = serde_json::Map::new();
    for m in methods {
        let request = (m.request)(&mut generator);
        let response = (m.response)(&mut generator);
        let mut responses = serde_json::Map::new();
        responses.insert("200".into(), json!({"description": "OK", "content": {"application/json": {"schema": response}}}));
        for status in ["400", "401", "403", "404", "409", "412", "422", "429", "500", "503"] {
            let codes: Vec<&str> = ErrorCode::ALL.iter().filter(|c| c.http_status().to_string() == status).map(|c| c.as_str()).collect();
            responses.insert(
                status.into(),
                json!({"description": codes.join(", "), "content": {"application/json": {"schema": error}}}),
            );
        }
        paths.insert(
            format!("/v1/{}", m.name),
            json!({"post": {
                "operationId": m.name,
                "summary": m.summary,
                "description": format!("{}\n\nPermission: {}.", m.summary, m.permission),
                "security": [{"bearer": []}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": request}}},
                "responses": responses,
            }}),
        );
    }
    paths.insert("/v1/watch".into(), watch_path(&error));
    paths.insert("/v1/audit.export".into(), audit_export_path(&error));
    if let Some(Value::Object(item)) = paths.get_mut("/v1/usage.export") {
        item.insert("get".into(), usage_export_get(&error));
    }
    if let Some(Value::Object(item)) = paths.get_mut("/v1/instances.console") {
        item.insert("get".into(), console_get(&error));
    }
    let schemas = generator.take_definitions(true);
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Better Compute API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "POST /v1/<method> with a JSON body. Errors are {code, message, details} with stable codes.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    })
}

/// `GET /v1/watch`: the event stream (Server-Sent Events), described for clients; its body is a
/// stream, so the fuzz leaves it out.
fn watch_path(error: &schemars::Schema) -> Value {
    let query = |name: &str, description: &str| {
        json!({"name": name, "in": "query", "required": false, "description": description, "schema": {"type": "string"}})
    };
    json!({"get": {
        "operationId": "watch",
        "summary": "Stream events as Server-Sent Events.",
        "description": "Server-Sent Events (`text/event-stream`) of the events the token may see: each event's `id` is its cursor, `event` its type and `data` the event as JSON. Reconnect with `Last-Event-ID` (or `lastEventId`) to resume right after that event; without one the stream starts now. A stream ends with an `end` event carrying the error when its token is revoked or expires, or its identity loses its last binding.",
        "security": [{"bearer": []}],
        "parameters": [
            query("types", "Event types to receive, comma-separated (default: all)."),
            query("subject", "Only events about this subject."),
            query("lastEventId", "Resume after this event (the Last-Event-ID header wins)."),
            {"name": "Last-Event-ID", "in": "header", "required": false, "description": "Resume after this event.", "schema": {"type": "string"}},
        ],
        "responses": {
            "200": {"description": "The event stream.", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "INVALID_ARGUMENT: an unknown query field, or a cursor this stream did not send", "content": {"application/json": {"schema": error}}},
            "401": {"description": "UNAUTHENTICATED", "content": {"application/json": {"schema": error}}},
            "403": {"description": "PERMISSION_DENIED: no binding that lets the token read events", "content": {"application/json": {"schema": error}}},
        },
    }})
}

/// `GET /v1/usage.export`: the same rows as the method, streamed whole as CSV or JSON lines.
fn usage_export_get(error: &schemars::Schema) -> Value {
    let query = |name: &str, required: bool, schema: Value, description: &str| {
        json!({"name": name, "in": "query", "required": required, "description": description, "schema": schema})
    };
    let text = json!({"schema": {"type": "string"}});
    json!({
        "operationId": "usage.export.stream",
        "summary": "Stream a period's usage windows as CSV or JSON lines.",
        "description": "Every usage window and adjustment whose window starts in [from, to), in billing-key order, as one streamed answer: CSV (`text/csv`, a header row first) or JSON lines (`application/x-ndjson`). An export cut by a failure ends without its last chunk, never as a shorter whole; resume with `after` set to the last key received.\n\nPermission: compute:usage:read at the tenant (at fleet scope with allTenants).",
        "security": [{"bearer": []}],
        "parameters": [
            query("from", true, json!({"type": "string"}), "RFC 3339: windows starting at or after it."),
            query("to", true, json!({"type": "string"}), "RFC 3339: windows starting before it."),
            query("format", false, json!({"type": "string", "enum": ["csv", "jsonl"]}), "csv (default) or jsonl."),
            query("tenantId", false, json!({"type": "string"}), "The caller's tenant; when given it must be the token's."),
            query("allTenants", false, json!({"type": "boolean"}), "Every tenant's usage (compute:usage:read at fleet scope)."),
            query("after", false, json!({"type": "string"}), "Resume after this billing key."),
        ],
        "responses": {
            "200": {"description": "The windows.", "content": {"text/csv": text, "application/x-ndjson": text}},
            "400": {"description": "INVALID_ARGUMENT: a bad period, format or field", "content": {"application/json": {"schema": error}}},
            "401": {"description": "UNAUTHENTICATED", "content": {"application/json": {"schema": error}}},
            "403": {"description": "PERMISSION_DENIED", "content": {"application/json": {"schema": error}}},
            "404": {"description": "NOT_FOUND: another tenant", "content": {"application/json": {"schema": error}}},
            "429": {"description": "RATE_LIMITED: the token's or tenant's request rate; retry after Retry-After", "content": {"application/json": {"schema": error}}},
            "503": {"description": "UNAVAILABLE", "content": {"application/json": {"schema": error}}},
        },
    })
}

/// `GET /v1/audit.export`: the whole audit log as JSON lines.
fn audit_export_path(error: &schemars::Schema) -> Value {
    json!({"get": {
        "operationId": "audit.export",
        "summary": "Export the audit log as JSON lines, for `better-compute audit verify`.",
        "description": "The audit log as JSON lines (`application/x-ndjson`): the anchor first when older entries were pruned (`type: anchor`, the checkpoint they were pruned below with its frontier), then every placed entry in log order (`type: entry`), each checkpoint after the last entry it covers (`type: checkpoint`). A cut export ends without its last chunk, never as a shorter whole.\n\nPermission: compute:audit:read at fleet scope (a tenant proves its own entries with audit.proof).",
        "security": [{"bearer": []}],
        "responses": {
            "200": {"description": "The log.", "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
            "400": {"description": "INVALID_ARGUMENT: an unknown query field", "content": {"application/json": {"schema": error}}},
            "401": {"description": "UNAUTHENTICATED", "content": {"application/json": {"schema": error}}},
            "403": {"description": "PERMISSION_DENIED: no compute:audit:read at fleet scope", "content": {"application/json": {"schema": error}}},
            "429": {"description": "RATE_LIMITED: the token's or tenant's request rate; retry after Retry-After", "content": {"application/json": {"schema": error}}},
            "503": {"description": "UNAVAILABLE", "content": {"application/json": {"schema": error}}},
        },
    }})
}

/// `GET /v1/instances.console`: the console as Server-Sent Events.
fn console_get(error: &schemars::Schema) -> Value {
    let query = |name: &str, required: bool, schema: Value, description: &str| {
        json!({"name": name, "in": "query", "required": required, "description": description, "schema": schema})
    };
    json!({
        "operationId": "instances.console.stream",
        "summary": "Follow an instance's serial console as Server-Sent Events.",
        "description": "Server-Sent Events (`text/event-stream`) of what the guest writes to its serial console: each `output` event's data is `{offset, nextOffset, text, truncated}` and its `id` the `nextOffset`, so a client reconnecting with `Last-Event-ID` resumes there. Starts with all that is kept (the last 64 KiB), or at `offset`. Ends with an `end` event: code OK when the instance was deleted, else the error (the token revoked or expired, the permission gone).\n\nPermission: compute:instances:console at tenant scope.",
        "security": [{"bearer": []}],
        "parameters": [
            query("instanceId", true, json!({"type": "string"}), "`ins_…`."),
            query("offset", false, json!({"type": "integer", "format": "int64"}), "The byte to start from (the Last-Event-ID header wins)."),
            query("tenantId", false, json!({"type": "string"}), "The caller's tenant; when given it must be the token's."),
            {"name": "Last-Event-ID", "in": "header", "required": false, "description": "Resume at this offset.", "schema": {"type": "string"}},
        ],
        "responses": {
            "200": {"description": "The console stream.", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "INVALID_ARGUMENT: an unknown query field or a bad offset", "content": {"application/json": {"schema": error}}},
            "401": {"description": "UNAUTHENTICATED", "content": {"application/json": {"schema": error}}},
            "403": {"description": "PERMISSION_DENIED: no compute:instances:console in the tenant", "content": {"application/json": {"schema": error}}},
            "404": {"description": "NOT_FOUND: no such instance in the tenant", "content": {"application/json": {"schema": error}}},
            "429": {"description": "RATE_LIMITED: the token's or tenant's request rate; retry after Retry-After", "content": {"application/json": {"schema": error}}},
            "503": {"description": "UNAVAILABLE: too many console streams on this process, or the database", "content": {"application/json": {"schema": error}}},
        },
    })
}

/// A schema with its `$ref` (if any) followed within `doc`.
pub fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => doc.pointer(r.trim_start_matches('#')).unwrap_or(schema),
        None => schema,
    }
}

fn type_name(doc: &Value, s: &Value) -> String {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        return format!("`{}`", r.rsplit('/').next().unwrap_or(r));
    }
    let s = resolve(doc, s);
    match s.get("type").and_then(Value::as_str) {
        Some("array") => format!("array of {}", s.get("items").map(|i| type_name(doc, i)).unwrap_or_else(|| "any".into())),
        Some(t) => t.to_owned(),
        None => "any JSON".to_owned(),
    }
}

/// The API reference page (`docs/api.md`), generated from the same document the server serves.
pub fn reference_page<'a>(methods: impl IntoIterator<Item = &'a Method>) -> String {
    let doc = document(methods);
    let mut out = String::from(
        "# API reference\n\n<!-- Generated by `better-compute docs api` from the OpenAPI document; do not edit. -->\n\n\
         Every method is `POST /v1/<method>` with a JSON body and `Authorization: Bearer <token>`. Errors are\n\
         `{ code, message, details }`: `INVALID_ARGUMENT` 400, `UNAUTHENTICATED` 401, `PERMISSION_DENIED` 403,\n\
         `NOT_FOUND` 404 (also for what you may not see), `CONFLICT` 409, `QUOTA_EXCEEDED` 409 (final until usage or\n\
         the quota changes, so generic retry middleware does not retry it), `FAILED_PRECONDITION` 412,\n\
         `UNSUPPORTED` 422, `RATE_LIMITED` 429 (with `Retry-After`), `UNAVAILABLE` 503, `INTERNAL` 500. Lists take `pageSize` and\n\
         `pageToken` and answer `items` and `nextPageToken`. A field's name ends in its unit: `S` for seconds\n\
         (`durationS`, `ttlS`), `Mib`, `Gib`, `Percent`, `PerS` (the older `ttlSeconds`, `notAfterSeconds` and\n\
         `graceSeconds` are accepted too). The machine-readable document is `GET /v1/openapi.json`.\n\n",
    );
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        let name = path.trim_start_matches("/v1/");
        if let Some(get) = item.get("get") {
            // A stream: GET, its parameters in the query (and a header).
            out.push_str(&format!("## `{name}` (`GET {path}`)\n\n{}\n\n", get["description"].as_str().unwrap_or("")));
            out.push_str("| parameter | in | description |\n|---|---|---|\n");
            for p in get["parameters"].as_array().into_iter().flatten() {
                out.push_str(&format!("| `{}` | {} | {} |\n", p["name"].as_str().unwrap_or(""), p["in"].as_str().unwrap_or(""), p["description"].as_str().unwrap_or("")));
            }
            let types: Vec<String> = get["responses"]["200"]["content"].as_object().into_iter().flatten().map(|(t, _)| format!("`{t}`")).collect();
            out.push_str(&format!("\nAnswers {}.\n\n", types.join(" or ")));
        }
        let Some(op) = item.get("post") else { continue };
        out.push_str(&format!("## `{name}`\n\n{}\n\n", op["description"].as_str().unwrap_or("")));
        let req = resolve(&doc, &op["requestBody"]["content"]["application/json"]["schema"]);
        let required: Vec<&str> = req["required"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        match req["properties"].as_object() {
            Some(props) if !props.is_empty() => {
                out.push_str("| field | type | required | description |\n|---|---|---|---|\n");
                for (name, p) in props {
                    let desc = resolve(&doc, p)["description"].as_str().or(p["description"].as_str()).unwrap_or("").replace('\n', " ").replace('|', "\\|");
                    out.push_str(&format!("| `{name}` | {} | {} | {desc} |\n", type_name(&doc, p), if required.contains(&name.as_str()) { "yes" } else { "no" }));
                }
            }
            _ => out.push_str("No fields.\n"),
        }
        let resp = &op["responses"]["200"]["content"]["application/json"]["schema"];
        out.push_str(&format!("\nAnswers {}.\n\n", type_name(&doc, resp)));
    }
    out
}
