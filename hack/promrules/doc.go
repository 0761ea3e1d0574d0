// Package promrules tests gpudra's Prometheus rules and Grafana dashboard
// (deployments/helm/gpudra/files): the rule file parses as `promtool check
// rules` parses it, the chart renders it unchanged, every metric the rules
// and the dashboard name is one the real collectors export, and each alert
// and recording rule, evaluated by Prometheus's own rule manager over
// scrapes of the real collectors on the simulator, fires in its case and
// stays silent in the healthy one.
//
// It is a module of its own so that github.com/prometheus/prometheus and
// what it pulls in never move the main module's dependencies. Run it with
// `make test-rules`.
package promrules
