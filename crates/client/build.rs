//! Generates the client from `openapi.json` (the API's document, kept equal to the server's by the
//! test `the_clients_openapi_document_matches_the_api`) with Oxide's progenitor.

use serde_json::Value;

fn main() {
    let src = "openapi.json";
    println!("cargo:rerun-if-changed={src}");
    let text = std::fs::read_to_string(src).expect("crates/client/openapi.json is readable");
    let mut doc: Value = serde_json::from_str(&text).expect("openapi.json is JSON");
    // `GET /v1/watch` takes its cursor as the `lastEventId` query field or the `Last-Event-ID`
    // header; both would become one Rust parameter, so the client sends the query field only.
    if let Some(Value::Array(params)) = doc.pointer_mut("/paths/~1v1~1watch/get/parameters") {
        params.retain(|p| p["in"] != "header");
    }
    let spec: openapiv3::OpenAPI = serde_json::from_value(doc).expect("openapi.json is an OpenAPI 3.0 document");
    let tokens = progenitor::Generator::default().generate_tokens(&spec).expect("progenitor generates the client");
    let file = syn::parse2(tokens).expect("the generated client parses");
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("client.rs");
    std::fs::write(out, prettyplease::unparse(&file)).expect("OUT_DIR is writable");
}
