//! `completions SHELL` and `man DIR`: the shell's completions and the manual pages, both from the
//! clap definition itself, so they cannot drift from the flags. In completions, `api` completes its
//! method names (every method this binary knows, from the same list the OpenAPI document is made
//! of, and `watch`); the parser itself still takes any name, so a newer server's method works.

use std::path::PathBuf;

use anyhow::Context;
use clap::CommandFactory;

/// Options of `better-compute completions`.
#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    shell: clap_complete::Shell,
}

/// Options of `better-compute man`.
#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// The folder to write the pages into (better-compute.1, better-compute-server.1, …).
    dir: PathBuf,
}

/// The command as completions see it: `api`'s method with the known names.
fn command_for_completions() -> clap::Command {
    let mut names: Vec<String> = better_compute_api::all_methods().iter().map(|m| m.name.to_owned()).collect();
    names.push("watch".to_owned());
    names.sort();
    // Positionals keep their order only with explicit indexes once one is changed.
    crate::Cli::command().mut_subcommand("api", |api| {
        api.mut_arg("method", |m| m.index(1).value_parser(clap::builder::PossibleValuesParser::new(names))).mut_arg("fields", |f| f.index(2))
    })
}

/// Prints the completion script for `args.shell`.
pub fn completions(args: CompletionsArgs) -> anyhow::Result<()> {
    let mut cmd = command_for_completions();
    clap_complete::generate(args.shell, &mut cmd, "better-compute", &mut std::io::stdout());
    Ok(())
}

/// Writes a manual page for the binary and one for each command (`better-compute-api.1`).
pub fn man(args: ManArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir).with_context(|| format!("cannot create {}", args.dir.display()))?;
    let cmd = crate::Cli::command();
    let mut written = 0;
    let mut pages = vec![(String::from("better-compute"), cmd.clone())];
    pages.extend(cmd.get_subcommands().filter(|s| !s.is_hide_set()).map(|s| (format!("better-compute-{}", s.get_name()), s.clone().name(format!("better-compute-{}", s.get_name())))));
    for (name, page) in pages {
        let path = args.dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(page).render(&mut out)?;
        std::fs::write(&path, out).with_context(|| format!("cannot write {}", path.display()))?;
        written += 1;
    }
    eprintln!("wrote {written} manual pages to {}", args.dir.display());
    Ok(())
}
