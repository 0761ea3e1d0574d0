package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/controller/grove"
	"github.com/gpudra/gpudra/pkg/kubeclient"
)

// clientFactory builds an API client and says which namespace the
// kubeconfig's context selects; tests replace it with a fake.
type clientFactory func(kubeconfig, context string) (kubernetes.Interface, string, error)

// kubeconfigClient loads the kubeconfig as kubectl does: --kubeconfig,
// else $KUBECONFIG, else ~/.kube/config, else in-cluster.
func kubeconfigClient(kubeconfig, context string) (kubernetes.Interface, string, error) {
	cfg, ns, err := loadKubeconfig(kubeconfig, context)
	if err != nil {
		return nil, "", err
	}
	// The plugin's client: only the groups gpudra reads, so the CLI does
	// not link every API group's client.
	client, err := kubeclient.NewForConfig(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("API client: %w", err)
	}
	return client, ns, nil
}

// loadKubeconfig loads the kubeconfig as kubectl does (kubeconfigClient):
// the REST config and the context's namespace.
func loadKubeconfig(kubeconfig, context string) (*rest.Config, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: context})
	ns, _, err := cc.Namespace()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	cfg.UserAgent = "gpudra-cli"
	return cfg, ns, nil
}

func newGroupsCommand(newClient clientFactory) *cobra.Command {
	var kubeconfig, kubeContext, namespace, output string
	var allNamespaces bool
	cmd := &cobra.Command{
		Use:   "groups",
		Short: "List Grove sharing groups: the claims Grove made for gpudra GPUs and the pods sharing them",
		Long: `List Grove sharing groups: each ResourceClaim that Grove (the PodCliqueSet operator) made
for resourceSharing and that uses gpudra devices, with the pods that reference it, the node
and devices it was allocated, its sharing mode, and the problems the gpudra controller
reports for it (see docs/sharing-groups.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output, "table", "wide", "json", "yaml"); err != nil {
				return err
			}
			client, ns, err := newClient(kubeconfig, kubeContext)
			if err != nil {
				return err
			}
			if namespace != "" {
				ns = namespace
			}
			if allNamespaces {
				ns = ""
			}
			groups, err := grove.ListGroups(cmd.Context(), client, ns, time.Now())
			if err != nil {
				return err
			}
			return printGroups(cmd.OutOrStdout(), groups, output)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&kubeconfig, "kubeconfig", "", "path to the kubeconfig file; default: $KUBECONFIG, ~/.kube/config or in-cluster")
	fs.StringVar(&kubeContext, "context", "", "kubeconfig context to use")
	fs.StringVarP(&namespace, "namespace", "n", "", "namespace; default: the context's")
	fs.BoolVarP(&allNamespaces, "all-namespaces", "A", false, "list groups in all namespaces")
	fs.StringVarP(&output, "output", "o", "table", "output format: table, wide (with consumer pods and GPU UUIDs), json or yaml")
	return cmd
}

// printGroups prints the groups; json and yaml print the very reports the
// controller analyses (grove.Group).
func printGroups(w io.Writer, groups []grove.Group, output string) error {
	switch output {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(groups)
	case "yaml":
		b, err := yaml.Marshal(groups)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	if len(groups) == 0 {
		_, err := fmt.Fprintln(w, "No Grove sharing groups found.")
		return err
	}
	wide := output == "wide"
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "NAMESPACE\tCLAIM\tLEVEL\tSCOPE\tOWNER\tCONSUMERS\tNODE\tDEVICES\tSHARING\tPROBLEMS"
	if wide {
		header += "\tPODS\tUUIDS"
	}
	fmt.Fprintln(tw, header)
	for _, g := range groups {
		owner := "<none>"
		if g.Owner != nil {
			owner = g.Owner.Name
		}
		var devices, uuids, pods, problems []string
		for _, d := range g.Devices {
			devices = append(devices, d.Device)
			if d.UUID != "" {
				uuids = append(uuids, d.UUID)
			}
		}
		for _, c := range g.Consumers {
			pods = append(pods, c.Name)
		}
		for _, p := range g.Problems {
			problems = append(problems, p.Reason)
		}
		row := []string{g.Namespace, g.Claim, string(g.Level), string(g.Scope), owner, strconv.Itoa(len(g.Consumers)),
			orNone(g.Node), list(devices), g.SharingMode(), list(problems)}
		if wide {
			row = append(row, list(pods), list(uuids))
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	return tw.Flush()
}

func orNone(s string) string {
	if s == "" {
		return "<none>"
	}
	return s
}

func list(items []string) string { return orNone(strings.Join(items, ",")) }
