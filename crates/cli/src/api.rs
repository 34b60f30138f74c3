//! `better-compute api METHOD key=value key:=json …`: the API client.
//!
//! `key=value` sends a string, `key:=json` sends JSON (numbers, booleans, arrays, objects), and a
//! dotted key nests (`gpu.count:=2`). `BETTER_COMPUTE_TENANT` fills `tenantId` when the method
//! takes one. `--list` and `METHOD --help` read the server's OpenAPI document.

use std::time::{Duration, Instant};

use crate::exit;
use crate::output::{self, Output};
use anyhow::Context;
use better_compute_api::openapi::resolve;
use serde_json::{Map, Value};

/// Where the API is and who calls it: the options every command that calls the API shares.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The server (default: the profile's, else http://127.0.0.1:8080).
    #[arg(long, env = "BETTER_COMPUTE_URL")]
    pub url: Option<String>,
    /// A bearer token (`bct_…`).
    #[arg(long, env = "BETTER_COMPUTE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Your tenant, sent as `tenantId` to methods that take one.
    #[arg(long, env = "BETTER_COMPUTE_TENANT")]
    pub tenant: Option<String>,
    /// A CA certificate (PEM) to trust besides the system's store, for an API behind a private CA.
    #[arg(long, env = "BETTER_COMPUTE_CA_CERT")]
    pub ca_cert: Option<std::path::PathBuf>,
    /// A profile of the config file (`better-compute login` writes one) instead of the current one;
    /// flags and variables given win over it.
    #[arg(long, env = "BETTER_COMPUTE_PROFILE")]
    pub profile: Option<String>,
}

/// Where the API is when nothing says.
const DEFAULT_URL: &str = "http://127.0.0.1:8080";

impl ServerArgs {
    /// Fills what was not given from the profile (`crate::profile`), then the defaults.
    pub fn resolve(mut self) -> anyhow::Result<ServerArgs> {
        if let Some((_, p)) = crate::profile::pick(self.profile.as_deref())? {
            self.url = self.url.or(Some(p.url));
            self.token = self.token.or(p.token);
            self.tenant = self.tenant.or(p.tenant);
            self.ca_cert = self.ca_cert.or(p.ca_cert);
        }
        self.url = Some(self.url.unwrap_or_else(|| DEFAULT_URL.to_owned()).trim_end_matches('/').to_owned());
        Ok(self)
    }

    /// The server's URL (after [`ServerArgs::resolve`]).
    pub fn url(&self) -> &str {
        self.url.as_deref().unwrap_or(DEFAULT_URL)
    }

    /// An HTTP client builder trusting the system's store and `--ca-cert`.
    pub fn http(&self) -> anyhow::Result<reqwest::ClientBuilder> {
        let pem = match &self.ca_cert {
            Some(p) => Some(std::fs::read(p).map_err(|e| exit::fail(exit::USAGE, format!("--ca-cert {}: {e}", p.display())))?),
            None => None,
        };
        better_compute_client::http_trusting(pem.as_deref()).map_err(|e| exit::fail(exit::USAGE, format!("--ca-cert: {e}")))
    }
}

/// Options of `better-compute api`.
#[derive(Debug, clap::Args)]
#[command(disable_help_flag = true)]
pub struct ApiArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// `table` (for people), `wide` (every column), `json`, `yaml` or `jsonpath=EXPR` (each value
    /// the path picks, one per line: `jsonpath=.items[*].id`).
    #[arg(long, short = 'o', default_value = "table")]
    output: String,
    /// A list: follow `nextPageToken` to the end and print every item.
    #[arg(long)]
    all: bool,
    /// List the methods.
    #[arg(long)]
    list: bool,
    /// Wait until the reservation is placed, the command has finished or the workflow has ended (or
    /// holds for an operator), showing progress (a workflow's steps as a live table).
    #[arg(long)]
    wait: bool,
    /// Follow: `instances.console` streams the console as the guest writes it, until Ctrl-C or
    /// the instance is deleted (reconnecting after a cut, resuming where it stopped).
    #[arg(long, short = 'f')]
    follow: bool,
    /// The longest `--wait` waits, in seconds.
    #[arg(long, default_value_t = 600)]
    wait_timeout_s: u64,
    /// Print help (`api METHOD --help` describes the method's fields).
    #[arg(long, short = 'h')]
    help: bool,
    /// The method, e.g. `reservations.create`.
    method: Option<String>,
    /// Fields: `key=value` (a string) or `key:=json`; dotted keys nest.
    #[arg(allow_hyphen_values = true)]
    fields: Vec<String>,
}

/// Builds the request body from `key=value` and `key:=json` arguments.
pub(crate) fn body_of(fields: &[String]) -> anyhow::Result<Map<String, Value>> {
    let mut body = Map::new();
    for f in fields {
        let (key, value) = if let Some((k, v)) = f.split_once(":=") {
            (k, serde_json::from_str(v).map_err(|e| exit::fail(exit::USAGE, format!("{k}:= takes JSON, e.g. {k}:=2 or {k}:='{{\"a\":1}}'; got {v:?} ({e})")))?)
        } else if let Some((k, v)) = f.split_once('=') {
            (k, Value::String(v.to_owned()))
        } else {
            return Err(exit::fail(exit::USAGE, format!("{f:?} is neither key=value nor key:=json")));
        };
        let parts: Vec<&str> = key.split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(exit::fail(exit::USAGE, format!("{key:?} is not a field name")));
        }
        let mut obj = &mut body;
        for p in &parts[..parts.len() - 1] {
            let next = obj.entry(p.to_string()).or_insert_with(|| Value::Object(Map::new()));
            obj = next.as_object_mut().with_context(|| format!("{key}: {p} is already set to a value that is not an object"))?;
        }
        obj.insert(parts[parts.len() - 1].to_owned(), value);
    }
    Ok(body)
}

struct Client {
    http: reqwest::Client,
    /// Without the request timeout, for streams.
    streams: reqwest::Client,
    url: String,
    token: Option<String>,
}

impl Client {
    async fn openapi(&self) -> anyhow::Result<Value> {
        let r = self.http.get(format!("{}/v1/openapi.json", self.url)).send().await.with_context(|| unreachable_hint(&self.url))?;
        Ok(r.json().await?)
    }

    /// Calls a method: the response body, or the API's error as `CODE: message`.
    async fn call(&self, method: &str, body: &Value) -> anyhow::Result<Value> {
        let token = self.token.as_deref().context("no token: set BETTER_COMPUTE_TOKEN (dev prints one; `admin bootstrap` makes the first)")?;
        let r = self
            .http
            .post(format!("{}/v1/{method}", self.url))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .with_context(|| unreachable_hint(&self.url))?;
        let status = r.status();
        let request_id = r.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let v: Value = r.json().await.with_context(|| format!("{method}: the server answered {status} without JSON"))?;
        if status.is_success() {
            return Ok(v);
        }
        let code = v["code"].as_str().unwrap_or("UNKNOWN");
        let hint = match code {
            "UNAUTHENTICATED" => "; check BETTER_COMPUTE_TOKEN",
            "NOT_FOUND" if v["message"].as_str().is_some_and(|m| m.starts_with("method")) => "; `better-compute api --list` lists the methods",
            "INVALID_ARGUMENT" => "; `better-compute api METHOD --help` lists the fields",
            _ => "",
        };
        Err(exit::api(code, format!("{}{hint} (request {request_id})", v["message"].as_str().unwrap_or(""))))
    }
}

pub fn unreachable_hint(url: &str) -> String {
    format!("cannot reach the API at {url}; is `better-compute dev` running? (set BETTER_COMPUTE_URL)")
}

fn request_schema<'a>(doc: &'a Value, method: &str) -> Option<&'a Value> {
    let op = doc.pointer(&format!("/paths/~1v1~1{method}/post"))?;
    Some(resolve(doc, op.pointer("/requestBody/content/application~1json/schema")?))
}

fn method_help(doc: &Value, method: &str) -> anyhow::Result<String> {
    let op = doc.pointer(&format!("/paths/~1v1~1{method}/post")).with_context(|| format!("no method {method}; `better-compute api --list` lists them"))?;
    let schema = request_schema(doc, method).cloned().unwrap_or(Value::Null);
    let required: Vec<&str> = schema["required"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let mut out = format!("{method}: {}\n\nFields:\n", op["description"].as_str().unwrap_or(""));
    if let Some(props) = schema["properties"].as_object() {
        for (name, p) in props {
            let p = resolve(doc, p);
            let ty = p["type"].as_str().unwrap_or(if p.get("properties").is_some() { "object" } else { "json" });
            let req = if required.contains(&name.as_str()) { " (required)" } else { "" };
            let how = if ty == "string" { format!("{name}=…") } else { format!("{name}:=…") };
            out.push_str(&format!("  {how:<28} {ty}{req}: {}\n", p["description"].as_str().unwrap_or("").replace('\n', " ")));
        }
    }
    out.push_str(&format!("\nExample: better-compute api {method} key=value key:=json\n"));
    Ok(out)
}

fn finished(method: &str, v: &Value) -> Option<bool> {
    let state = v["state"].as_str()?;
    Some(if method.starts_with("reservations.") {
        state != "pending"
    } else if method.starts_with("workflows.") {
        // Held waits for an operator: as far as a waiting CLI goes, it is done.
        matches!(state, "succeeded" | "failed" | "cancelled" | "held")
    } else {
        matches!(state, "succeeded" | "failed" | "expired" | "cancelled")
    })
}

/// Runs `api`.
pub async fn run(mut args: ApiArgs) -> anyhow::Result<()> {
    args.server = args.server.resolve()?;
    // Flags written after the fields arrive among them.
    let mut fields = Vec::new();
    let mut it = std::mem::take(&mut args.fields).into_iter();
    while let Some(f) = it.next() {
        match f.as_str() {
            "--wait" => args.wait = true,
            "--wait-timeout-s" => {
                args.wait_timeout_s = it.next().and_then(|v| v.parse().ok()).ok_or_else(|| exit::fail(exit::USAGE, "--wait-timeout-s takes seconds"))?
            }
            "--follow" | "-f" => args.follow = true,
            "--help" | "-h" => args.help = true,
            "--output" | "-o" => args.output = it.next().ok_or_else(|| exit::fail(exit::USAGE, format!("--output takes {}", output::FORMATS)))?,
            "--all" => args.all = true,
            _ if f.starts_with("--output=") => args.output = f["--output=".len()..].to_owned(),
            _ => fields.push(f),
        }
    }
    let format: Output = args.output.parse().map_err(|e: String| exit::fail(exit::USAGE, e))?;
    args.fields = fields;
    let client = Client { http: args.server.http()?.timeout(Duration::from_secs(60)).build()?, streams: args.server.http()?.build()?, url: args.server.url().to_owned(), token: args.server.token.clone() };
    if args.list {
        let doc = client.openapi().await?;
        let mut out = String::new();
        for (path, item) in doc["paths"].as_object().into_iter().flatten() {
            out.push_str(&format!("{:<28} {}\n", path.trim_start_matches("/v1/"), item["post"]["summary"].as_str().unwrap_or("")));
        }
        print!("{out}");
        return Ok(());
    }
    let Some(method) = args.method.clone() else {
        println!("usage: better-compute api METHOD key=value key:=json … [--output json] [--wait]\n       better-compute api --list\n       better-compute api METHOD --help");
        return if args.help { Ok(()) } else { Err(exit::fail(exit::USAGE, "name a method; `better-compute api --list` lists them")) };
    };
    if method == "watch" {
        if args.help {
            println!("watch: print your tenant's events as they happen (GET /v1/watch, Server-Sent Events).\n\nFields:\n  types=a,b         only these event types\n  subject=…         only events about this subject\n  lastEventId=…     resume after this event id (printed with -o json)\n\nRuns until Ctrl-C; reconnects by itself, resuming where it stopped.");
            return Ok(());
        }
        return watch(&client, &args.fields, &args.output).await;
    }
    if args.help {
        print!("{}", method_help(&client.openapi().await?, &method)?);
        return Ok(());
    }
    let mut body = body_of(&args.fields)?;
    if let Some(t) = &args.server.tenant && !body.contains_key("tenantId") {
        let doc = client.openapi().await?;
        if request_schema(&doc, &method).is_some_and(|s| s["properties"].get("tenantId").is_some()) {
            body.insert("tenantId".into(), Value::String(t.clone()));
        }
    }
    if method == "instances.console" && args.follow {
        return follow_console(&client, &body, &args.output).await;
    }
    let mut v = client.call(&method, &Value::Object(body.clone())).await?;
    if args.all {
        v = every_page(&client, &method, body.clone(), v).await?;
    }
    if method == "instances.console" && args.output != "json" {
        print_console(&v);
        return Ok(());
    }
    if args.wait && method.starts_with("workflows.") && v["steps"].is_array() {
        v = wait_workflow(&client, &args, v).await?;
    } else if args.wait && finished(&method, &v) == Some(false) {
        v = wait(&client, &args, &method, v).await?;
    }
    print!("{}", output::render(&v, &format)?);
    Ok(())
}

/// `--all`: the items of every page after `first`, as one page.
async fn every_page(client: &Client, method: &str, mut body: Map<String, Value>, first: Value) -> anyhow::Result<Value> {
    let Some(items) = first.get("items").and_then(Value::as_array) else {
        return Err(exit::fail(exit::USAGE, format!("--all follows pages of a list; {method} answers no items")));
    };
    let mut all = items.clone();
    let mut next = first.get("nextPageToken").and_then(Value::as_str).map(str::to_owned);
    while let Some(token) = next {
        body.insert("pageToken".into(), Value::String(token));
        let page = client.call(method, &Value::Object(body.clone())).await?;
        all.extend(page["items"].as_array().into_iter().flatten().cloned());
        next = page.get("nextPageToken").and_then(Value::as_str).map(str::to_owned);
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprint!("\r{} items…", all.len());
        }
    }
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }
    Ok(serde_json::json!({"items": all}))
}

/// `--wait`: polls the reservation or command through the typed client until it is placed or
/// finished, showing its state.
async fn wait(client: &Client, args: &ApiArgs, method: &str, mut v: Value) -> anyhow::Result<Value> {
    use better_compute_client::types;
    let token = client.token.as_deref().context("no token: set BETTER_COMPUTE_TOKEN")?;
    let typed = better_compute_client::Client::with_token_on(&client.url, token, args.server.http()?.timeout(Duration::from_secs(60)))?;
    let id = v["id"].as_str().context("the answer has no id to wait on")?.to_owned();
    let node = v["nodeId"].as_str().unwrap_or_default().to_owned();
    let get = if method.starts_with("reservations.") { "reservations.get" } else { "commands.get" };
    let started = Instant::now();
    while finished(method, &v) == Some(false) {
        if started.elapsed() > Duration::from_secs(args.wait_timeout_s) {
            eprintln!();
            return Err(exit::fail(exit::WAIT_TIMEOUT, format!("{id} is still {} after {} s; read it later with `better-compute api {get}`", v["state"], args.wait_timeout_s)));
        }
        eprint!("\rwaiting for {id}: {} ({} s)   ", v["state"].as_str().unwrap_or(""), started.elapsed().as_secs());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let tenant_id = args.server.tenant.clone();
        v = if get == "reservations.get" {
            serde_json::to_value(typed.reservations_get(&types::ReservationRef { tenant_id, reservation_id: id.clone() }).await.map_err(refusal)?.into_inner())?
        } else {
            serde_json::to_value(typed.commands_get(&types::CommandRef { tenant_id, node_id: node.clone(), command_id: id.clone() }).await.map_err(refusal)?.into_inner())?
        };
    }
    eprintln!("\r{id}: {} after {} s        ", v["state"].as_str().unwrap_or(""), started.elapsed().as_secs());
    Ok(v)
}

/// `--wait` on a workflow: its steps as a table, redrawn in place on a terminal as they move,
/// until it succeeds, fails, is cancelled or holds for an operator.
async fn wait_workflow(client: &Client, args: &ApiArgs, mut v: Value) -> anyhow::Result<Value> {
    use std::io::IsTerminal;
    let token = client.token.as_deref().context("no token: set BETTER_COMPUTE_TOKEN")?;
    let typed = better_compute_client::Client::with_token_on(&client.url, token, args.server.http()?.timeout(Duration::from_secs(60)))?;
    let id = v["id"].as_str().context("the answer has no id to wait on")?.to_owned();
    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let (mut drawn, mut last) = (0usize, String::new());
    loop {
        let t = workflow_table(&v);
        if t != last {
            if tty && drawn > 0 {
                // Up over the last drawing, and clear it.
                eprint!("\x1b[{drawn}A\x1b[J");
            }
            eprint!("{t}");
            drawn = t.lines().count();
            last = t;
        }
        if finished("workflows.get", &v) != Some(false) {
            return Ok(v);
        }
        if started.elapsed() > Duration::from_secs(args.wait_timeout_s) {
            return Err(exit::fail(exit::WAIT_TIMEOUT, format!("{id} is still {} after {} s; read it later with `better-compute api workflows.get workflowId={id}`", v["state"], args.wait_timeout_s)));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let r = typed.workflows_get(&better_compute_client::types::WorkflowRef { tenant_id: args.server.tenant.clone(), workflow_id: id.clone() }).await.map_err(refusal)?;
        v = serde_json::to_value(r.into_inner())?;
    }
}

/// A workflow and its steps, one line each.
fn workflow_table(v: &Value) -> String {
    let on = v["nodeId"].as_str().map(String::from).unwrap_or_else(|| format!("fleet {}", v["target"]));
    let mut s = format!("{} {} on {}: {}", output::scalar(&v["id"]), output::scalar(&v["definition"]), on, output::scalar(&v["state"]));
    if let Some(m) = v["message"].as_str() {
        s.push_str(&format!(" ({m})"));
    }
    s.push('\n');
    if let Some(c) = v.get("children").filter(|c| c.is_object()) {
        s.push_str(&format!(
            "  nodes: {} started, {} running, {} succeeded, {} failed, {} held\n",
            c["started"], c["running"], c["succeeded"], c["failed"], c["held"]
        ));
    }
    s.push_str(&format!("  {:<12} {:<10} {:>8}  {}\n", "STEP", "STATE", "ATTEMPTS", "MESSAGE"));
    for st in v["steps"].as_array().into_iter().flatten() {
        let msg: String = st["message"].as_str().unwrap_or("").chars().take(100).collect();
        s.push_str(&format!("  {:<12} {:<10} {:>8}  {}\n", output::scalar(&st["name"]), output::scalar(&st["state"]), output::scalar(&st["attempts"]), msg));
    }
    s
}

/// The typed client's error as the CLI prints the API's: `CODE: message`.
fn refusal(e: better_compute_client::Error<better_compute_client::types::Error>) -> anyhow::Error {
    match e {
        better_compute_client::Error::ErrorResponse(r) => exit::api(&r.code.to_string(), &r.message),
        better_compute_client::Error::CommunicationError(e) => anyhow::Error::new(e),
        other => anyhow::anyhow!("{other}"),
    }
}

/// One Server-Sent Events stream, reconnecting after a cut (at most 10 failed connects in a row),
/// resuming after the last `id` it saw: `show` gets each event's type and data and says whether
/// the stream goes on. An `end` event ends it: an error, unless its code is `OK`.
async fn follow_sse(
    client: &Client,
    path: &str,
    query: &[(String, String)],
    mut last: Option<String>,
    mut show: impl FnMut(&str, &str),
) -> anyhow::Result<()> {
    let token = client.token.as_deref().context("no token: set BETTER_COMPUTE_TOKEN")?;
    let http = client.streams.clone();
    let mut failures = 0u32;
    loop {
        let mut req = http.get(format!("{}/v1/{path}", client.url)).bearer_auth(token).query(query);
        if let Some(l) = &last {
            req = req.header("Last-Event-ID", l);
        }
        let mut resp = match req.send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                return Err(exit::api(v["code"].as_str().unwrap_or("ERROR"), v["message"].as_str().unwrap_or("")));
            }
            Err(e) if failures < 10 => {
                failures += 1;
                eprintln!("{path}: {e}; reconnecting…");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e).with_context(|| unreachable_hint(&client.url)),
        };
        failures = 0;
        let mut parser = crate::sse::Parser::default();
        while let Ok(Some(chunk)) = resp.chunk().await {
            for e in parser.push(&chunk)? {
                if e.event == "end" {
                    // The server ended the stream: the token was revoked or expired, the bindings
                    // went, or (a console) the instance was deleted.
                    let v: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
                    let message = v["message"].as_str().unwrap_or("the server ended the stream");
                    if v["code"] == "OK" {
                        eprintln!("{path}: {message}");
                        return Ok(());
                    }
                    return Err(exit::api(v["code"].as_str().unwrap_or("ERROR"), message));
                }
                let Some(id) = e.id else { continue };
                last = Some(id);
                show(&e.event, &e.data);
            }
        }
        eprintln!("{path}: stream ended; resuming after {}", last.as_deref().unwrap_or("now"));
    }
}

/// `api watch`: streams events, reconnecting with `Last-Event-ID` after a cut.
async fn watch(client: &Client, fields: &[String], output: &str) -> anyhow::Result<()> {
    let body = body_of(fields)?;
    let last = body.get("lastEventId").and_then(Value::as_str).map(String::from);
    let mut query: Vec<(String, String)> = Vec::new();
    for (k, v) in &body {
        match k.as_str() {
            "types" | "subject" => query.push((k.clone(), v.as_str().map(String::from).unwrap_or_else(|| v.to_string()))),
            "lastEventId" | "tenantId" => {}
            other => return Err(exit::fail(exit::USAGE, format!("watch takes types=, subject= and lastEventId=, not {other}"))),
        }
    }
    follow_sse(client, "watch", &query, last, |_, data| {
        if output == "json" {
            println!("{data}");
        } else {
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            println!("{}  {:<28} {:<34} {}", output::scalar(&v["time"]), output::scalar(&v["type"]), output::scalar(&v["subject"]), v["data"]);
        }
    })
    .await
}

/// Prints a console page's text as the guest wrote it, saying on stderr when older bytes are gone.
fn print_console(page: &Value) {
    use std::io::Write;
    if page["truncated"] == true {
        eprintln!("(console bytes before offset {} are no longer kept)", page["offset"]);
    }
    print!("{}", page["text"].as_str().unwrap_or(""));
    let _ = std::io::stdout().flush();
}

/// `api instances.console … --follow`: the console as the guest writes it, until Ctrl-C or the
/// instance is deleted.
async fn follow_console(client: &Client, body: &Map<String, Value>, output: &str) -> anyhow::Result<()> {
    let mut query: Vec<(String, String)> = Vec::new();
    for (k, v) in body {
        match k.as_str() {
            "instanceId" | "tenantId" | "offset" => query.push((k.clone(), v.as_str().map(String::from).unwrap_or_else(|| v.to_string()))),
            other => return Err(exit::fail(exit::USAGE, format!("instances.console takes instanceId=, offset:= and tenantId=, not {other}"))),
        }
    }
    follow_sse(client, "instances.console", &query, None, |_, data| {
        if output == "json" {
            println!("{data}");
        } else {
            print_console(&serde_json::from_str(data).unwrap_or(Value::Null));
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_become_a_nested_body() {
        let f: Vec<String> = ["poolId=pool_1", "gpu.kind=gpu", "gpu.count:=2", "payload:={\"a\":[1]}"].iter().map(|s| s.to_string()).collect();
        let b = body_of(&f).unwrap();
        assert_eq!(Value::Object(b), serde_json::json!({"poolId": "pool_1", "gpu": {"kind": "gpu", "count": 2}, "payload": {"a": [1]}}));
        assert!(body_of(&["x:=nope".to_string()]).is_err());
        assert!(body_of(&["novalue".to_string()]).is_err());
        assert!(body_of(&["a=1".to_string(), "a.b=2".to_string()]).is_err());
    }

}
