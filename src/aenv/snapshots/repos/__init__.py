"""Repository backends: one abstract interface (`base.Repository`), implementations side by
side (`local.LocalRepository`, `s3.S3Repository`), chosen by `aenv.snapshots.repository.
open_repository` from the configuration and tested through the same contract tests."""
