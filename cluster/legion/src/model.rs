//! Models by name or file: a zoo name, a JSON model file or an ONNX file (with its weights).

/// Resolves `--model` (a zoo name, a JSON model file or an ONNX file) at the given batch / image
/// size / classes.
pub fn load_model(
    model: &str,
    batch: usize,
    image_size: Option<usize>,
    classes: Option<usize>,
) -> anyhow::Result<legion_ops::Graph> {
    Ok(resolve_model(model, batch, image_size, classes)?.graph)
}

/// A model as `--model` named it: its graph, the weights its file carries, and for an ONNX file
/// what the import found (to show the user, warnings first of all).
#[derive(Debug)]
pub struct ResolvedModel {
    pub graph: legion_ops::Graph,
    pub weights: Option<legion_ops::checkpoint::Checkpoint>,
    pub import: Option<legion_onnx::ImportSummary>,
}

/// Resolves `--model` as [`load_model`] does, with the weights the model file carries (an ONNX
/// file's initializers; `None` for zoo and JSON models and graph-only exports) and what its
/// import found.
pub fn resolve_model(
    model: &str,
    batch: usize,
    image_size: Option<usize>,
    classes: Option<usize>,
) -> anyhow::Result<ResolvedModel> {
    use anyhow::Context;
    if batch == 0 {
        anyhow::bail!("--batch must be at least 1");
    }
    if let Some(z) = legion_ops::zoo::find(model) {
        let mut cfg = z.default_config(batch);
        if let Some(s) = image_size {
            cfg.image_size = s;
        }
        if let Some(c) = classes {
            cfg.classes = c;
        }
        // A zoo model fails to build only for the sizes the flags gave it: say which.
        let graph = z.build(&cfg).with_context(|| {
            format!(
                "--model {model} at --image-size {} (its default: {}), --batch {batch}, \
                 --classes {}",
                cfg.image_size,
                z.default_config(batch).image_size,
                cfg.classes
            )
        })?;
        return Ok(ResolvedModel {
            graph,
            weights: None,
            import: None,
        });
    }
    let path = std::path::Path::new(model);
    if !path.exists() {
        anyhow::bail!(
            "--model '{model}' is neither a zoo model ({}) nor an existing JSON or ONNX file",
            legion_ops::zoo::names().join(", ")
        );
    }
    if image_size.is_some() || classes.is_some() {
        anyhow::bail!(
            "--image-size and --classes apply to zoo models; a JSON or ONNX model fixes its own \
             shapes"
        );
    }
    let (graph, weights, import) = if is_onnx(path) {
        let imported = legion_onnx::load(path)?;
        (imported.graph, imported.weights, Some(imported.summary))
    } else {
        (legion_ops::Graph::load_json(path)?, None, None)
    };
    let graph = graph
        .with_batch(batch)
        .with_context(|| format!("{model}: re-inferring shapes at batch {batch}"))?;
    Ok(ResolvedModel {
        graph,
        weights,
        import,
    })
}

/// Whether `--model` names an ONNX file (by its extension; anything else is read as JSON).
fn is_onnx(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}

/// The zoo model `name` (see `legion_ops::zoo::names`) at the sizes of `cfg`.
pub fn zoo(name: &str, cfg: legion_ops::zoo::ZooConfig) -> anyhow::Result<legion_ops::Graph> {
    let Some(model) = legion_ops::zoo::find(name) else {
        anyhow::bail!(
            "'{name}' is not a zoo model; the zoo has {}",
            legion_ops::zoo::names().join(", ")
        );
    };
    Ok(model.build(&cfg)?)
}
