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
        for status in ["400", "401", "403", "404", "409", "412", "422", "429", "503"] {
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
