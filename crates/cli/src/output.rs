//! How the CLI prints an answer (`-o`): `table` (for people: a list's columns with `state` first,
//! at most eight, one line per item; one object as `key  value` lines), `wide` (every column),
//! `json`, `yaml`, or `jsonpath=EXPR` (each value `EXPR` picks, one per line: `.items[*].id`,
//! `.state`, `.atoms[0]`). Columns are padded by display width (a CJK character takes two
//! cells, a combining mark none), so names in any script line up.

use anyhow::{bail, Context};
use serde_json::Value;
use unicode_width::UnicodeWidthStr;

/// An `-o` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Columns for people.
    Table,
    /// Every column.
    Wide,
    /// Pretty JSON.
    Json,
    /// YAML.
    Yaml,
    /// The values a path picks.
    JsonPath(String),
}

/// What `-o` accepts, for messages.
pub const FORMATS: &str = "table, wide, json, yaml or jsonpath=EXPR";

impl std::str::FromStr for Output {
    type Err = String;

    fn from_str(s: &str) -> Result<Output, String> {
        Ok(match s {
            "table" | "text" => Output::Table,
            "wide" => Output::Wide,
            "json" => Output::Json,
            "yaml" => Output::Yaml,
            _ => match s.strip_prefix("jsonpath=") {
                Some(expr) => {
                    steps(expr).map_err(|e| format!("{e:#}"))?;
                    Output::JsonPath(expr.to_owned())
                }
                None => return Err(format!("-o takes {FORMATS}, not {s:?}")),
            },
        })
    }
}

/// `v` as `o` prints it.
pub fn render(v: &Value, o: &Output) -> anyhow::Result<String> {
    Ok(match o {
        Output::Table => table(v, false),
        Output::Wide => table(v, true),
        Output::Json => format!("{}\n", serde_json::to_string_pretty(v)?),
        Output::Yaml => {
            let mut s = String::new();
            yaml(v, 0, &mut s);
            s
        }
        Output::JsonPath(expr) => pick(v, expr)?.iter().map(|x| format!("{}\n", scalar(x))).collect(),
    })
}

/// A cell: strings bare, null as `-`, a list of scalars joined with commas, anything else as JSON.
pub fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.iter().all(|x| !x.is_object() && !x.is_array()) => a.iter().map(scalar).collect::<Vec<_>>().join(","),
        // A small object of scalars (a reservation's gpu) as `key=value` pairs.
        Value::Object(o) if o.len() <= 4 && o.values().all(|x| !x.is_object() && !x.is_array()) => {
            o.iter().filter(|(_, x)| !x.is_null()).map(|(k, x)| format!("{k}={}", scalar(x))).collect::<Vec<_>>().join(",")
        }
        other => other.to_string(),
    }
}

/// The columns shown first, in this order, when an item has them.
const FIRST: [&str; 4] = ["state", "id", "name", "kind"];

/// A resource's default columns in `table`, by its id's prefix (`res_…`); `wide` shows every one.
fn columns_of(id: &str) -> Option<&'static [&'static str]> {
    Some(match id.split('_').next()? {
        "res" => &["state", "id", "poolId", "nodeId", "gpu", "vcpu", "memoryMib", "startsAt", "endsAt"],
        "ins" => &["state", "id", "reservationId", "nodeId", "image", "address", "flavour"],
        "node" => &["liveness", "id", "name", "poolId", "generation", "observedGeneration", "noScheduleReasons"],
        "cmd" => &["state", "id", "nodeId", "kind", "seq", "reason"],
        "wf" => &["state", "id", "definition", "nodeId", "currentStep", "requestedBy"],
        "aud" => &["at", "actorId", "action", "target", "outcome", "requestId"],
        _ => return None,
    })
}
/// The most columns `table` shows (`wide` shows all).
const MAX_COLUMNS: usize = 8;
/// The widest a cell is shown in `table`, in terminal cells (`wide` shows it whole).
const MAX_CELL_CHARS: usize = 48;

fn table(v: &Value, wide: bool) -> String {
    let Some(items) = v.get("items").and_then(Value::as_array) else {
        return match v.as_object() {
            Some(o) => o.iter().map(|(k, x)| format!("{k:<20} {}\n", scalar(x))).collect(),
            None => format!("{}\n", scalar(v)),
        };
    };
    // Every key any item has, first ones first; in `table`, only those whose values are
    // scalars or lists of scalars in every item (a nested object is for -o json or wide).
    let mut keys: Vec<&str> = Vec::new();
    for i in items.iter().filter_map(Value::as_object) {
        for k in i.keys() {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
    }
    let nested = |x: &Value| x.is_object() || x.is_array();
    let flat = |k: &str| items.iter().all(|i| !i[k].is_object() && !i[k].as_array().is_some_and(|a| a.iter().any(nested)));
    let preferred = items.first().and_then(|i| i["id"].as_str()).and_then(columns_of).filter(|_| !wide);
    let cols: Vec<&str> = match preferred {
        Some(p) => p.iter().copied().filter(|c| keys.contains(c)).collect(),
        None => {
            let mut cols: Vec<&str> = FIRST.iter().copied().filter(|c| keys.contains(c)).collect();
            cols.extend(keys.iter().copied().filter(|k| !FIRST.contains(k) && (wide || flat(k))));
            if !wide {
                cols.truncate(MAX_COLUMNS);
            }
            cols
        }
    };
    let clip = |s: String| if wide || s.width() <= MAX_CELL_CHARS { s } else { clip_to(&s, MAX_CELL_CHARS - 1) + "…" };
    let rows: Vec<Vec<String>> = items.iter().map(|i| cols.iter().map(|c| clip(scalar(&i[*c]))).collect()).collect();
    let header: Vec<String> = cols.iter().map(|c| upper_snake(c)).collect();
    let widths: Vec<usize> = (0..cols.len()).map(|n| rows.iter().map(|r| r[n].width()).chain([header[n].width()]).max().unwrap_or(0)).collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c}{}", " ".repeat(w - c.width()))).collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header);
    for r in &rows {
        out.push_str(&line(r));
    }
    if let Some(next) = v.get("nextPageToken").and_then(Value::as_str) {
        out.push_str(&format!("(more: pageToken={next}, or --all)\n"));
    }
    out
}

/// The longest start of `s` at most `cells` wide.
fn clip_to(s: &str, cells: usize) -> String {
    let mut used = 0;
    s.chars()
        .take_while(|c| {
            used += unicode_width::UnicodeWidthChar::width(*c).unwrap_or(0);
            used <= cells
        })
        .collect()
}

/// `createdAt` as `CREATED_AT`.
fn upper_snake(key: &str) -> String {
    let mut s = String::new();
    for (i, c) in key.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            s.push('_');
        }
        s.extend(c.to_uppercase());
    }
    s
}

/// Block-style YAML; strings are double-quoted (JSON's quoting is YAML's), so nothing is misread.
fn yaml(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(o) if !o.is_empty() => {
            for (k, x) in o {
                let key = if k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.') { k.clone() } else { Value::String(k.clone()).to_string() };
                match x {
                    Value::Object(m) if !m.is_empty() => {
                        out.push_str(&format!("{pad}{key}:\n"));
                        yaml(x, indent + 2, out);
                    }
                    Value::Array(a) if !a.is_empty() => {
                        out.push_str(&format!("{pad}{key}:\n"));
                        yaml(x, indent, out);
                    }
                    _ => out.push_str(&format!("{pad}{key}: {}\n", x)),
                }
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for x in a {
                match x {
                    Value::Object(m) if !m.is_empty() => {
                        // The first key on the dash's line, the rest under it.
                        let mut inner = String::new();
                        yaml(x, indent + 2, &mut inner);
                        out.push_str(&format!("{pad}- {}", &inner[indent + 2..]));
                    }
                    Value::Array(b) if !b.is_empty() => {
                        out.push_str(&format!("{pad}-\n"));
                        yaml(x, indent + 2, out);
                    }
                    _ => out.push_str(&format!("{pad}- {x}\n")),
                }
            }
        }
        other => out.push_str(&format!("{pad}{other}\n")),
    }
}

/// One step of a path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
    All,
}

/// `.items[*].id`, `$.state`, `{.atoms[0]}`: keys after dots, `[N]` and `[*]`.
fn steps(expr: &str) -> anyhow::Result<Vec<Step>> {
    let e = expr.trim();
    let e = e.strip_prefix('{').and_then(|x| x.strip_suffix('}')).unwrap_or(e);
    let e = e.strip_prefix('$').unwrap_or(e);
    let mut steps = Vec::new();
    let mut rest = e;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            if end == 0 {
                bail!("jsonpath {expr:?}: a dot needs a key after it");
            }
            steps.push(Step::Key(r[..end].to_owned()));
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').with_context(|| format!("jsonpath {expr:?}: a [ without ]"))?;
            steps.push(match &r[..end] {
                "*" => Step::All,
                n => Step::Index(n.parse().with_context(|| format!("jsonpath {expr:?}: [{n}] is neither [*] nor an index"))?),
            });
            rest = &r[end + 1..];
        } else {
            bail!("jsonpath {expr:?}: write keys after dots, like .items[*].id");
        }
    }
    Ok(steps)
}

/// The values `expr` picks from `v`, in order.
fn pick<'a>(v: &'a Value, expr: &str) -> anyhow::Result<Vec<&'a Value>> {
    let mut at = vec![v];
    for s in steps(expr)? {
        at = at
            .into_iter()
            .flat_map(|x| -> Vec<&Value> {
                match &s {
                    Step::Key(k) => x.get(k).into_iter().collect(),
                    Step::Index(n) => x.get(*n).into_iter().collect(),
                    Step::All => x.as_array().map(|a| a.iter().collect()).unwrap_or_default(),
                }
            })
            .collect();
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn list() -> Value {
        json!({"items": [
            {"id": "thing_1", "tenantId": "ten_a", "state": "active", "atoms": ["GPU-1", "GPU-2"], "spec": {"vcpu": 8, "more": [1]}, "note": "ünïcödé"},
            {"id": "thing_2", "tenantId": "ten_a", "state": "pending", "atoms": [], "spec": {"vcpu": 4, "more": [1]}, "note": "-"}
        ], "nextPageToken": "thing_2"})
    }

    #[test]
    fn a_table_puts_state_first_leaves_nested_objects_to_wide_and_pads_by_characters() {
        let t = render(&list(), &Output::Table).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        // serde_json keeps keys sorted: after the first columns, the others in name order.
        assert_eq!(lines[0], "STATE    ID       ATOMS        NOTE     TENANT_ID", "{t}");
        assert!(!lines[0].contains("SPEC"), "a nested object is not a column: {t}");
        assert_eq!(lines[1], "active   thing_1  GPU-1,GPU-2  ünïcödé  ten_a", "padded by characters, not bytes: {t}");
        assert_eq!(lines[2], "pending  thing_2               -        ten_a", "{t}");
        assert_eq!(lines[3], "(more: pageToken=thing_2, or --all)");
        let w = render(&list(), &Output::Wide).unwrap();
        assert!(w.lines().next().unwrap().contains("SPEC") && w.contains(r#"{"more":[1],"vcpu":8}"#), "{w}");
    }

    #[test]
    fn wide_characters_take_two_cells_and_long_cells_are_clipped_to_the_width() {
        let page = json!({"items": [{"id": "t_1", "name": "漢字"}, {"id": "t_2", "name": "ab"}, {"id": "t_3", "name": "x".repeat(60)}]});
        let t = render(&page, &Output::Table).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[1], "t_1  漢字");
        assert_eq!(lines[2], "t_2  ab");
        assert!(lines[3].ends_with(&format!("{}…", "x".repeat(47))), "{t}");
        assert_eq!(clip_to("漢字漢字", 5), "漢字");
    }

    #[test]
    fn a_known_resource_gets_its_own_columns() {
        let page = json!({"items": [{"id": "res_1", "state": "active", "poolId": "pool_1", "nodeId": null, "gpu": {"kind": "gpu", "model": "H100", "count": 2, "profile": null},
                                     "vcpu": 8, "memoryMib": 1024, "startsAt": "s", "endsAt": "e", "atoms": ["a"], "version": 3}]});
        let t = render(&page, &Output::Table).unwrap();
        assert_eq!(t, "STATE   ID     POOL_ID  NODE_ID  GPU                          VCPU  MEMORY_MIB  STARTS_AT  ENDS_AT\nactive  res_1  pool_1   -        count=2,kind=gpu,model=H100  8     1024        s          e\n");
        assert!(render(&page, &Output::Wide).unwrap().contains("VERSION"));
    }

    #[test]
    fn jsonpath_picks_each_value_and_yaml_quotes_every_string() {
        let o: Output = "jsonpath={.items[*].state}".parse().unwrap();
        assert_eq!(render(&list(), &o).unwrap(), "active\npending\n");
        assert_eq!(render(&list(), &"jsonpath=.items[0].atoms[1]".parse().unwrap()).unwrap(), "GPU-2\n");
        assert_eq!(render(&list(), &"jsonpath=.nothing".parse().unwrap()).unwrap(), "");
        assert!("jsonpath=items".parse::<Output>().is_err());
        assert!("jsonpath=.items[x]".parse::<Output>().is_err());
        assert!("xml".parse::<Output>().is_err());
        let y = render(&json!({"id": "res_1", "atoms": ["a"], "spec": {"vcpu": 8, "note": "yes"}, "list": [{"k": 1, "j": "no"}]}), &Output::Yaml).unwrap();
        assert_eq!(y, "atoms:\n- \"a\"\nid: \"res_1\"\nlist:\n- j: \"no\"\n  k: 1\nspec:\n  note: \"yes\"\n  vcpu: 8\n");
    }
}
