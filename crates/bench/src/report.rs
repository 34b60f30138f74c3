//! `better-compute bench all`: runs every benchmark one after another and writes one report (Markdown,
//! JSON, and an SVG of the latency distributions) with the machine, the versions, and each figure
//! beside the baseline measured in the same run. The benchmarks record their figures here as they
//! print them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde::Serialize;

/// One measured figure, beside its baseline when it has one.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Figure {
    bench: String,
    name: String,
    value: f64,
    unit: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline: Option<Baseline>,
}

/// What a figure is compared with, measured on the same database in the same run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Baseline {
    name: String,
    value: f64,
    /// `value / baseline`, both in their own units.
    ratio: f64,
}

/// A latency distribution for the chart: sorted samples in milliseconds (at most 2,000, evenly
/// picked, so the report stays small).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Latencies {
    name: String,
    samples_ms: Vec<f64>,
}

/// One figure of a benchmark run at several sizes (sessions, nodes), for the scaling table.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Scaled {
    what: String,
    size: usize,
    value: f64,
    unit: String,
}

/// One statement of a profile: where the database's time went in one phase of a benchmark.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Statement {
    pub(crate) query: String,
    pub(crate) calls: i64,
    pub(crate) total_ms: f64,
    pub(crate) mean_ms: f64,
    pub(crate) share_pct: f64,
}

/// The statements that took the most time in one phase.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Profile {
    phase: String,
    statements: Vec<Statement>,
}

static FIGURES: Mutex<Vec<Figure>> = Mutex::new(Vec::new());
static PROFILES: Mutex<Vec<Profile>> = Mutex::new(Vec::new());
static SCALING: Mutex<Vec<Scaled>> = Mutex::new(Vec::new());
static LATENCIES: Mutex<Vec<Latencies>> = Mutex::new(Vec::new());

/// A goal a figure is held to; the report says whether the figure meets it.
struct Target {
    /// The figure's name, exactly as recorded.
    figure: &'static str,
    /// Met when the value (or the ratio, with `ratio`) is at most this, or at least it.
    bound: Bound,
    /// Compare the ratio to the figure's baseline instead of the value.
    ratio: bool,
}

enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

/// The goals of the paths a fleet operator feels. A report without a figure leaves its goal out.
const TARGETS: &[Target] = &[
    Target { figure: "command enqueue to daemon at 1000/s, 10000 sessions, p50", bound: Bound::AtMost(5.0), ratio: false },
    Target { figure: "command enqueue to daemon at 1000/s, 10000 sessions, p99", bound: Bound::AtMost(50.0), ratio: false },
    Target { figure: "commands enqueued at 1000/s asked, 10000 sessions", bound: Bound::AtLeast(990.0), ratio: false },
    Target { figure: "convergence: 10000 nodes apply one change to every node", bound: Bound::AtMost(10.0), ratio: false },
    Target { figure: "desired-state recomputations, 10000 nodes, one worker", bound: Bound::AtLeast(0.7), ratio: true },
    Target { figure: "events committed and delivered to 100 watch streams", bound: Bound::AtLeast(0.7), ratio: true },
    Target { figure: "commit to SSE client, p99", bound: Bound::AtMost(50.0), ratio: false },
    Target { figure: "reservations.create over HTTP, p99", bound: Bound::AtMost(100.0), ratio: false },
    Target { figure: "nodes.get over HTTP", bound: Bound::AtLeast(0.7), ratio: true },
    Target { figure: "placements, 1000 nodes x 8 GPUs, 64 clients", bound: Bound::AtLeast(1.0), ratio: true },
    Target { figure: "placements in a burst with no release, 1000 nodes", bound: Bound::AtLeast(0.8), ratio: true },
    Target { figure: "sessions opened (mTLS handshake to Welcome), 10000 sessions", bound: Bound::AtLeast(1000.0), ratio: false },
];

/// Each goal with a figure in the report: (figure, goal, measured, met).
fn targets(figures: &[Figure]) -> Vec<(String, String, String, bool)> {
    TARGETS
        .iter()
        .filter_map(|t| {
            let f = figures.iter().find(|f| f.name == t.figure)?;
            let (measured, shown) = if t.ratio {
                let r = f.baseline.as_ref()?.ratio;
                (r, format!("{r:.2}x"))
            } else {
                (f.value, format!("{} {}", number(f.value), f.unit))
            };
            let unit = if t.ratio { "x".to_owned() } else { format!(" {}", f.unit) };
            let (goal, met) = match t.bound {
                Bound::AtMost(b) => (format!("≤ {}{unit}", number(b)), measured <= b),
                Bound::AtLeast(b) => (format!("≥ {}{unit}", number(b)), measured >= b),
            };
            Some((f.name.clone(), goal, shown, met))
        })
        .collect()
}

/// Records a figure of `bench` (printed by the benchmark itself).
pub(crate) fn figure(bench: &str, name: impl Into<String>, value: f64, unit: &str, baseline: Option<(&str, f64)>) {
    let baseline = baseline.map(|(n, b)| Baseline { name: n.to_owned(), value: b, ratio: if b > 0.0 { value / b } else { 0.0 } });
    FIGURES.lock().expect("figures").push(Figure { bench: bench.into(), name: name.into(), value, unit: unit.into(), baseline });
}

/// Records a figure at one size of a run repeated at several sizes (the scaling table).
pub(crate) fn scaled(what: &str, size: usize, value: f64, unit: &str) {
    SCALING.lock().expect("scaling").push(Scaled { what: what.into(), size, value, unit: unit.into() });
}

/// Records where the database's time went in one phase of a benchmark.
pub(crate) fn profile(phase: &str, statements: Vec<Statement>) {
    PROFILES.lock().expect("profiles").push(Profile { phase: phase.into(), statements });
}

/// The `p` quantile of sorted latencies, in milliseconds (0 when there are none).
pub(crate) fn pct_ms(sorted: &[Duration], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p) as usize).map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
}

/// Records a latency distribution (any order) for the chart.
pub(crate) fn latencies(name: impl Into<String>, samples: &[Duration]) {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    const KEEP: usize = 2_000;
    if ms.len() > KEEP {
        let step = (ms.len() - 1) as f64 / (KEEP - 1) as f64;
        ms = (0..KEEP).map(|i| ms[(i as f64 * step).round() as usize]).collect();
    }
    LATENCIES.lock().expect("latencies").push(Latencies { name: name.into(), samples_ms: ms });
}

/// Options of `bench all`.
#[derive(Debug, clap::Args)]
pub struct AllBench {
    /// Folder for the report: `bench.md`, `bench.json`, `bench-latency.svg`.
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,
    /// Smaller runs (fewer nodes, sessions and requests), for a quick look; the report says so.
    #[arg(long)]
    quick: bool,
}

/// Parses a benchmark's options from its defaults plus `args`, as its own subcommand would.
fn defaults<T: clap::Args>(args: &[&str]) -> anyhow::Result<T> {
    #[derive(clap::Parser)]
    struct Wrap<T: clap::Args> {
        #[command(flatten)]
        inner: T,
    }
    Ok(Wrap::<T>::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?.inner)
}

/// Runs every benchmark and writes the report.
pub async fn run(b: AllBench) -> anyhow::Result<()> {
    type Step = (&'static str, Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>>>>>);
    let q = b.quick;
    let steps: Vec<Step> = vec![
        ("runtime: reconciles and outbox", {
            let a = defaults::<crate::RuntimeBench>(if q { &["--keys", "10000", "--events", "5000"] } else { &[] })?;
            Box::new(move || Box::pin(crate::runtime_bench(a)))
        }),
        ("capacity: placements", {
            let a = defaults::<crate::capacity::CapacityBench>(if q { &["--nodes", "100,1000", "--steady-placements", "1000", "--placements", "1000"] } else { &[] })?;
            Box::new(move || Box::pin(crate::capacity::run(a)))
        }),
        ("commands: enqueue and desired state", {
            let a = defaults::<crate::commands::CommandsBench>(if q { &["--nodes", "1000", "--commands", "5000"] } else { &[] })?;
            Box::new(move || Box::pin(crate::commands::run(a)))
        }),
        ("api: HTTP beside in-process", {
            let a = defaults::<crate::api::ApiBench>(if q { &["--requests", "1000"] } else { &[] })?;
            Box::new(move || Box::pin(crate::api::run(a)))
        }),
        ("events: outbox to watch streams", {
            let a = defaults::<crate::events::EventsBench>(if q { &["--events", "500"] } else { &[] })?;
            Box::new(move || Box::pin(crate::events::run(a)))
        }),
        ("gateway: sessions, command latency, convergence", {
            // The largest size is what one process may hold here: each session is a descriptor in
            // the gateway and one in the simulated fleet, under a hard limit of 20,000 on the
            // machines this report is written on.
            let a = defaults::<crate::gateway::GatewayBench>(if q { &["--sessions", "1000", "--command-seconds", "5"] } else { &["--sessions", "1000,10000,18000"] })?;
            Box::new(move || Box::pin(crate::gateway::run(a)))
        }),
    ];
    std::fs::create_dir_all(&b.out).with_context(|| format!("create {}", b.out.display()))?;
    let started = Instant::now();
    let total = steps.len();
    let mut failed = Vec::new();
    for (i, (name, step)) in steps.into_iter().enumerate() {
        progress(i, total, name, started.elapsed());
        let t = Instant::now();
        // One benchmark failing (a missing pgbench, say) does not lose the others' figures.
        if let Err(e) = step().await {
            eprintln!("bench {name} failed: {e:#}");
            failed.push(format!("{name}: {e:#}"));
        }
        println!("  ({name}: {:.0} s)", t.elapsed().as_secs_f64());
    }
    progress(total, total, "done", started.elapsed());
    let report = Report {
        generated_at: better_compute_core::time::rfc3339(std::time::SystemTime::now()),
        quick: q,
        took_s: started.elapsed().as_secs_f64().round(),
        machine: machine(),
        versions: versions(),
        figures: FIGURES.lock().expect("figures").clone(),
        scaling: SCALING.lock().expect("scaling").clone(),
        profiles: PROFILES.lock().expect("profiles").clone(),
        latencies: LATENCIES.lock().expect("latencies").clone(),
        failed,
    };
    write(&b.out, &report)?;
    println!("report: {}, {}, {}", b.out.join("bench.md").display(), b.out.join("bench.json").display(), b.out.join("bench-latency.svg").display());
    Ok(())
}

/// A progress bar between benchmarks (they print their own lines while they run).
fn progress(done: usize, total: usize, next: &str, elapsed: Duration) {
    const WIDTH: usize = 30;
    let filled = WIDTH * done / total.max(1);
    println!(
        "[{}{}] {done}/{total} {:>4.0} s  {}",
        "#".repeat(filled),
        "-".repeat(WIDTH - filled),
        elapsed.as_secs_f64(),
        if done < total { format!("running {next}…") } else { next.to_owned() }
    );
}

#[derive(Debug, Serialize)]
struct Report {
    generated_at: String,
    quick: bool,
    took_s: f64,
    machine: Vec<(String, String)>,
    versions: Vec<(String, String)>,
    figures: Vec<Figure>,
    scaling: Vec<Scaled>,
    profiles: Vec<Profile>,
    latencies: Vec<Latencies>,
    failed: Vec<String>,
}

fn first_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().trim().to_owned())
}

fn machine() -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo.lines().find_map(|l| l.strip_prefix("model name")?.split(':').nth(1).map(|s| s.trim().to_owned()));
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:")?.split_whitespace().next()?.parse::<u64>().ok());
    vec![
        ("cpu".into(), cpu.unwrap_or_else(|| "unknown".into())),
        ("cores".into(), std::thread::available_parallelism().map(|n| n.get().to_string()).unwrap_or_default()),
        ("memory".into(), mem_kib.map(|k| format!("{:.1} GiB", k as f64 / 1024.0 / 1024.0)).unwrap_or_default()),
        ("kernel".into(), first_line("uname", &["-sr"]).unwrap_or_default()),
    ]
}

fn versions() -> Vec<(String, String)> {
    let pg = better_compute_db::launcher::PgBinaries::find().ok();
    let bin = |name: &str| pg.as_ref().map(|b| b.bindir().join(name).display().to_string()).unwrap_or_else(|| name.to_owned());
    vec![
        ("better-compute".into(), env!("CARGO_PKG_VERSION").into()),
        ("commit".into(), first_line("git", &["describe", "--always", "--dirty"]).unwrap_or_else(|| "unknown".into())),
        ("postgres".into(), first_line(&bin("postgres"), &["--version"]).unwrap_or_default()),
        ("pgbench".into(), first_line(&bin("pgbench"), &["--version"]).unwrap_or_default()),
        ("rustc".into(), first_line("rustc", &["--version"]).unwrap_or_default()),
    ]
}

fn write(out: &Path, r: &Report) -> anyhow::Result<()> {
    std::fs::write(out.join("bench.json"), serde_json::to_string_pretty(r)?)?;
    std::fs::write(out.join("bench-latency.svg"), svg(&r.latencies))?;
    std::fs::write(out.join("bench.md"), markdown(r))?;
    Ok(())
}

fn number(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Benchmark report\n");
    let _ = writeln!(
        s,
        "Written by `better-compute bench all{}` on {} in {:.0} minutes. Every figure is measured on a throwaway \
         PostgreSQL cluster with fsync and synchronous_commit on, beside its baseline measured on the same \
         database in the same run; the ratio is figure / baseline. These machines are shared: read ratios, \
         not absolute numbers.\n",
        if r.quick { " --quick" } else { "" },
        r.generated_at,
        r.took_s / 60.0
    );
    let _ = writeln!(s, "| machine | |\n|---|---|");
    for (k, v) in &r.machine {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(s, "\n| version | |\n|---|---|");
    for (k, v) in &r.versions {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(s, "\n## Figures\n\n| bench | figure | value | baseline | ratio |\n|---|---|---:|---|---:|");
    for f in &r.figures {
        let (base, ratio) = match &f.baseline {
            Some(b) => (format!("{} ({})", b.name, number(b.value)), format!("{:.2}x", b.ratio)),
            None => ("".into(), "".into()),
        };
        let _ = writeln!(s, "| {} | {} | {} {} | {base} | {ratio} |", f.bench, f.name, number(f.value), f.unit);
    }
    let goals = targets(&r.figures);
    if !goals.is_empty() {
        let _ = writeln!(s, "\n## Targets\n\nWhy a goal is not met, and what would meet it: [performance.md](../performance.md).\n\n| figure | goal | measured | |\n|---|---|---:|---|");
        for (name, goal, measured, met) in goals {
            let _ = writeln!(s, "| {name} | {goal} | {measured} | {} |", if met { "met" } else { "**not met**" });
        }
    }
    if !r.scaling.is_empty() {
        scaling_table(&mut s, &r.scaling);
    }
    if !r.profiles.is_empty() {
        let _ = writeln!(
            s,
            "\n## Where the database's time goes\n\nThe statements with the most execution time (lock waits included) in each \
             phase, from pg_stat_statements on the benchmark's cluster.\n"
        );
        for p in &r.profiles {
            let _ = writeln!(s, "**{}**\n\n| share | calls | total | each | statement |\n|---:|---:|---:|---:|---|", p.phase);
            for st in &p.statements {
                let q = st.query.replace('|', "\\|").replace('`', "'");
                let _ = writeln!(s, "| {:.1}% | {} | {} ms | {} ms | `{q}` |", st.share_pct, st.calls, number(st.total_ms), number(st.mean_ms));
            }
            let _ = writeln!(s);
        }
    }
    if !r.latencies.is_empty() {
        let _ = writeln!(s, "\n## Latency distributions\n\n![latency distributions](bench-latency.svg)\n\n| distribution | samples | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|---:|");
        for l in &r.latencies {
            let p = |q: f64| l.samples_ms.get(((l.samples_ms.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
            let _ = writeln!(s, "| {} | {} | {} ms | {} ms | {} ms | {} ms |", l.name, l.samples_ms.len(), number(p(0.5)), number(p(0.9)), number(p(0.99)), number(p(1.0)));
        }
    }
    if !r.failed.is_empty() {
        let _ = writeln!(s, "\n## Benchmarks that failed\n");
        for f in &r.failed {
            let _ = writeln!(s, "- {f}");
        }
    }
    s
}

/// Each scaled figure across the sizes it was measured at, with the growth from the smallest size
/// to the largest beside the growth of the size itself.
fn scaling_table(s: &mut String, scaled: &[Scaled]) {
    let mut sizes: Vec<usize> = scaled.iter().map(|x| x.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut whats: Vec<(&str, &str)> = Vec::new();
    for x in scaled {
        if !whats.iter().any(|(w, _)| *w == x.what) {
            whats.push((&x.what, &x.unit));
        }
    }
    let _ = write!(s, "\n## Scaling\n\n| figure |");
    for n in &sizes {
        let _ = write!(s, " {n} |");
    }
    let _ = writeln!(s, " largest / smallest |\n|---|{}---:|", "---:|".repeat(sizes.len()));
    for (what, unit) in whats {
        let at = |n: usize| scaled.iter().find(|x| x.what == what && x.size == n).map(|x| x.value);
        let _ = write!(s, "| {what} |");
        for &n in &sizes {
            let _ = write!(s, " {} |", at(n).map(|v| format!("{} {unit}", number(v))).unwrap_or_default());
        }
        let measured: Vec<(usize, f64)> = sizes.iter().filter_map(|&n| Some((n, at(n)?))).collect();
        let growth = match (measured.first(), measured.last()) {
            (Some((n0, v0)), Some((n1, v1))) if n1 > n0 && *v0 > 0.0 => format!("{:.2}x for {:.0}x the size", v1 / v0, *n1 as f64 / *n0 as f64),
            _ => String::new(),
        };
        let _ = writeln!(s, " {growth} |");
    }
}

/// The distributions as cumulative curves: latency on a log scale across, fraction of requests up.
fn svg(ls: &[Latencies]) -> String {
    const W: f64 = 960.0;
    const H: f64 = 420.0;
    const L: f64 = 60.0; // left margin
    const B: f64 = 40.0; // bottom margin
    const T: f64 = 20.0;
    const R: f64 = 330.0; // right margin, for the legend
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
    let all = ls.iter().flat_map(|l| l.samples_ms.iter().copied()).filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo <= hi { (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil())) } else { (0.1, 1000.0) };
    let x = |v: f64| L + (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10()).max(1e-9) * (W - L - R);
    let y = |q: f64| T + (1.0 - q) * (H - T - B);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    // Axes and grid: a line per decade, and at the quartiles and 90%.
    let mut d = lo;
    while d <= hi * 1.0001 {
        let _ = writeln!(s, "<line x1=\"{:.1}\" y1=\"{T}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>", x(d), x(d), H - B);
        let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} ms</text>", x(d), H - B + 15.0, number(d));
        d *= 10.0;
    }
    for q in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
        let _ = writeln!(s, "<line x1=\"{L}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>", y(q), W - R, y(q));
        let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}%</text>", L - 5.0, y(q) + 4.0, q * 100.0);
    }
    let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">latency (log scale); up: fraction of requests at most that slow</text>", (L + W - R) / 2.0, H - 8.0);
    for (i, l) in ls.iter().enumerate() {
        let c = colors[i % colors.len()];
        let n = l.samples_ms.len().max(1) as f64;
        let points: Vec<String> = l.samples_ms.iter().enumerate().map(|(k, v)| format!("{:.1},{:.1}", x(*v), y((k + 1) as f64 / n))).collect();
        let _ = writeln!(s, "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>", points.join(" "));
        let ly = T + 10.0 + i as f64 * 16.0;
        let _ = writeln!(s, "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{c}\" stroke-width=\"3\"/>", W - R + 10.0, W - R + 28.0);
        let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>", W - R + 33.0, ly + 4.0, xml(&l.name));
    }
    s.push_str("</svg>\n");
    s
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_puts_each_figure_beside_its_baseline_and_draws_each_distribution() {
        let r = Report {
            generated_at: "2026-12-03T00:00:00Z".into(),
            quick: true,
            took_s: 60.0,
            machine: vec![("cores".into(), "2".into())],
            versions: vec![("postgres".into(), "postgres (PostgreSQL) 15.8".into())],
            figures: vec![Figure {
                bench: "capacity".into(),
                name: "placements in a burst with no release, 1000 nodes".into(),
                value: 150.0,
                unit: "/s".into(),
                baseline: Some(Baseline { name: "pgbench TPC-B".into(), value: 3000.0, ratio: 0.05 }),
            }],
            scaling: vec![
                Scaled { what: "memory per session".into(), size: 1000, value: 40.0, unit: "KiB".into() },
                Scaled { what: "memory per session".into(), size: 10000, value: 50.0, unit: "KiB".into() },
            ],
            profiles: vec![Profile {
                phase: "gateway: opening".into(),
                statements: vec![Statement { query: "SELECT a | b".into(), calls: 3, total_ms: 12.0, mean_ms: 4.0, share_pct: 50.0 }],
            }],
            latencies: vec![Latencies { name: "a <b>".into(), samples_ms: vec![1.0, 2.0, 3.0, 40.0] }],
            failed: vec![],
        };
        let md = markdown(&r);
        assert!(md.contains("| capacity | placements in a burst with no release, 1000 nodes | 150 /s | pgbench TPC-B (3000) | 0.05x |"), "{md}");
        assert!(md.contains("| a <b> | 4 | 3.00 ms |"), "{md}");
        assert!(md.contains("| figure | 1000 | 10000 | largest / smallest |"), "{md}");
        assert!(md.contains("| placements in a burst with no release, 1000 nodes | ≥ 0.80x | 0.05x | **not met** |"), "{md}");
        assert!(md.contains("| 50.0% | 3 | 12.0 ms | 4.00 ms | `SELECT a \\| b` |"), "{md}");
        assert!(md.contains("| memory per session | 40.0 KiB | 50.0 KiB | 1.25x for 10x the size |"), "{md}");
        let svg = svg(&r.latencies);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.contains("a &lt;b&gt;") && svg.contains("100 ms"), "{svg}");
    }

    #[test]
    fn a_benchmarks_defaults_parse_and_overrides_apply() {
        let a: crate::capacity::CapacityBench = defaults(&["--nodes", "100"]).unwrap();
        assert!(format!("{a:?}").contains("nodes: [100]"), "{a:?}");
        assert!(defaults::<crate::capacity::CapacityBench>(&["--no-such-flag"]).is_err());
    }
}
