package devcluster

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// WaitForPods waits until every pod of the namespace is Running or the
// timeout passes; it returns the pods that are not running then.
func (c *Cluster) WaitForPods(ctx context.Context, namespace string, timeout time.Duration) ([]string, error) {
	var notRunning []string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		notRunning = notRunning[:0]
		for _, p := range pods.Items {
			if p.Status.Phase != v1.PodRunning {
				notRunning = append(notRunning, p.Name)
			}
		}
		return len(notRunning) == 0, nil
	})
	if err != nil && len(notRunning) > 0 {
		return notRunning, fmt.Errorf("pods not running after %s: %v", timeout, notRunning)
	}
	return nil, err
}
