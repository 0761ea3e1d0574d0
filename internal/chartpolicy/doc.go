// Package chartpolicy holds tests of the Helm chart's admission policies
// (deployments/helm/gpudra/templates) against the Kubernetes API types they
// guard: a policy that names fields one by one must name every field the
// API has, and a new Kubernetes version may add one.
package chartpolicy
