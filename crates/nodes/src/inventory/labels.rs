//! Node labels: changing them (`nodes.update`), and the label selectors of `nodes.list`
//! (`rack=r1,gpu!=L4,ssd,!spot`).

use better_compute_core::bounds::{KEY_CHARS, SELECTOR_ENTRIES, VALUE_CHARS};
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use tokio_postgres::GenericClient;

/// A parsed label selector: every term must hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector {
    /// `key=value`: the label is there with this value.
    pub equal: serde_json::Map<String, serde_json::Value>,
    /// `key!=value`: the label is absent or has another value.
    pub not_equal: serde_json::Map<String, serde_json::Value>,
    /// `key`: the label is there.
    pub present: Vec<String>,
    /// `!key`: the label is absent.
    pub absent: Vec<String>,
}

fn check_key(key: &str) -> Result<(), Error> {
    if key.is_empty() || key.chars().count() > KEY_CHARS || key.chars().any(|c| c.is_whitespace() || c.is_control() || "=!,".contains(c)) {
        return Err(Error::invalid_argument(format!(
            "label key {key:?} must be 1 to {KEY_CHARS} characters without spaces, '=', '!' or ','"
        )));
    }
    Ok(())
}

fn check_value(key: &str, value: &str) -> Result<(), Error> {
    if value.chars().count() > VALUE_CHARS || value.chars().any(|c| c.is_control() || c == ',') {
        return Err(Error::invalid_argument(format!("label {key}'s value must be at most {VALUE_CHARS} characters without ','")));
    }
    Ok(())
}

impl LabelSelector {
    /// Parses `rack=r1,gpu!=L4,ssd,!spot` (`==` is `=`; spaces around terms are ignored).
    pub fn parse(s: &str) -> Result<LabelSelector, Error> {
        let mut sel = LabelSelector::default();
        let terms: Vec<&str> = s.split(',').map(str::trim).collect();
        if terms.len() > SELECTOR_ENTRIES {
            return Err(Error::invalid_argument(format!("a label selector has at most {SELECTOR_ENTRIES} terms")));
        }
        for term in terms {
            if term.is_empty() {
                return Err(Error::invalid_argument(format!("label selector {s:?} has an empty term; write terms like rack=r1,gpu!=L4,ssd,!spot")));
            }
            if let Some((k, v)) = term.split_once("!=") {
                let (k, v) = (k.trim(), v.trim());
                check_key(k)?;
                check_value(k, v)?;
                sel.not_equal.insert(k.to_owned(), v.into());
            } else if let Some((k, v)) = term.split_once('=') {
                let (k, v) = (k.trim(), v.trim_start_matches('=').trim());
                check_key(k)?;
                check_value(k, v)?;
                if sel.equal.insert(k.to_owned(), v.into()).is_some() {
                    return Err(Error::invalid_argument(format!("label selector {s:?} asks for {k} twice")));
                }
            } else if let Some(k) = term.strip_prefix('!') {
                check_key(k.trim())?;
                sel.absent.push(k.trim().to_owned());
            } else {
                check_key(term)?;
                sel.present.push(term.to_owned());
            }
        }
        Ok(sel)
    }

    /// The SQL condition on `labels` for this selector, its parameters numbered from `first`, and
    /// the parameters in order.
    pub fn sql(&self, first: usize) -> (String, [serde_json::Value; 4]) {
        let (a, b, c, d) = (first, first + 1, first + 2, first + 3);
        (
            format!(
                "labels @> ${a}::jsonb AND NOT EXISTS (SELECT 1 FROM jsonb_each_text(${b}::jsonb) x WHERE labels->>x.key = x.value)
                 AND labels ?& ARRAY(SELECT jsonb_array_elements_text(${c}::jsonb)) AND NOT labels ?| ARRAY(SELECT jsonb_array_elements_text(${d}::jsonb))"
            ),
            [
                serde_json::Value::Object(self.equal.clone()),
                serde_json::Value::Object(self.not_equal.clone()),
                serde_json::json!(self.present),
                serde_json::json!(self.absent),
            ],
        )
    }
}

/// `nodes.update labels`: merges `changes` into the node's labels (a `null` value removes the
/// label). Reservations select nodes by labels, so the node's counts and desired state follow
/// through the `node.labelsChanged` event and a recomputation. Returns whether anything changed.
pub async fn update_labels(tx: &impl GenericClient, node_id: &str, changes: &serde_json::Map<String, serde_json::Value>) -> Result<bool, DbError> {
    if changes.len() > SELECTOR_ENTRIES {
        return Err(Error::invalid_argument(format!("at most {SELECTOR_ENTRIES} labels change at once")).into());
    }
    for (k, v) in changes {
        check_key(k)?;
        match v {
            serde_json::Value::Null => {}
            serde_json::Value::String(s) => check_value(k, s)?,
            _ => return Err(Error::invalid_argument(format!("label {k}: a value is a string, or null to remove the label")).into()),
        }
    }
    let changes = serde_json::Value::Object(changes.clone());
    let row = tx
        .query_opt(
            "WITH old AS (SELECT labels FROM nodes WHERE id = $1 FOR UPDATE)
             UPDATE nodes n SET labels = jsonb_strip_nulls(n.labels || $2::jsonb),
                    version = n.version + CASE WHEN jsonb_strip_nulls(n.labels || $2::jsonb) = old.labels THEN 0 ELSE 1 END
               FROM old WHERE n.id = $1
             RETURNING n.labels <> old.labels, n.labels",
            &[&node_id, &changes],
        )
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    let changed: bool = row.get(0);
    if changed {
        let labels: serde_json::Value = row.get(1);
        outbox::emit(tx, NewEvent { event_type: "node.labelsChanged", tenant_id: None, subject: node_id, data: serde_json::json!({"labels": labels}) }).await?;
        better_compute_runtime::desired::invalidate(tx, node_id).await?;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selector_parses_every_kind_of_term() {
        let s = LabelSelector::parse("rack=r1, gpu!=L4,ssd,!spot,zone==a").unwrap();
        assert_eq!(s.equal.len(), 2);
        assert_eq!(s.equal["rack"], "r1");
        assert_eq!(s.equal["zone"], "a");
        assert_eq!(s.not_equal["gpu"], "L4");
        assert_eq!(s.present, ["ssd"]);
        assert_eq!(s.absent, ["spot"]);
    }

    #[test]
    fn a_bad_selector_is_refused_with_a_reason() {
        for bad in ["", "rack=r1,,x", "rack=a,rack=b", "=v", "!", "a b=c"] {
            let e = LabelSelector::parse(bad).unwrap_err();
            assert_eq!(e.code, better_compute_core::ErrorCode::InvalidArgument, "{bad}");
        }
        let many = vec!["k"; SELECTOR_ENTRIES + 1].join(",");
        assert!(LabelSelector::parse(&many).is_err());
    }
}
